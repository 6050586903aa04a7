"""Text classification: tables of sentences, the tokenizer, encoders with exits, and the pipeline on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from anytime.backbones import create_model
from anytime.calibrate import ExitPolicy
from anytime.data import TextOptions, load_dataset, make_loader
from anytime.data.text import TOKENIZER_FILE, read_table
from anytime.errors import AnytimeError
from anytime.families import attach_exits

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"
GOOD = ("good", "great", "fine", "lovely", "superb", "warm")
BAD = ("bad", "awful", "poor", "dull", "boring", "cold")


def _sentences(count: int, seed: int) -> list[tuple[int, str]]:
    """Labelled sentences whose label is told by a few words among neutral ones, of varied lengths."""
    rng = np.random.default_rng(seed)
    neutral = ("the", "film", "was", "a", "story", "with", "actors", "and", "music", "plot")
    rows = []
    for i in range(count):
        label = i % 2
        words = list(rng.choice(neutral, size=int(rng.integers(2, 14))))
        for _ in range(int(rng.integers(1, 3))):
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(GOOD if label else BAD)))
        rows.append((label, " ".join(words)))
    return rows


def _write(path: Path, rows: list[tuple[int, str]], column: str = "content") -> None:
    sep = "\t" if path.suffix == ".tsv" else ","
    path.write_text(f"label{sep}{column}\n" + "".join(f"{y}{sep}{t}\n" for y, t in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def text_root(tmp_path_factory) -> Path:
    """A textfolder: train.tsv (with a 'sentence' column, as SST-2's), dev.csv and test.tsv."""
    root = tmp_path_factory.mktemp("textfolder")
    _write(root / "train.tsv", _sentences(400, 0), column="sentence")
    _write(root / "dev.csv", _sentences(60, 1))
    _write(root / "test.tsv", _sentences(80, 2))
    return root


@pytest.fixture(scope="module")
def text_run(text_root, tmp_path_factory) -> Path:
    """A MobileBERT-shaped encoder with exits after every layer, trained for 2 epochs on the textfolder."""
    from anytime.train import TrainConfig, Trainer

    run = tmp_path_factory.mktemp("text-run") / "run"
    config = TrainConfig(model="mobilebert_tiny", data="textfolder", data_root=str(text_root), epochs=2,
                         batch_size=32, lr=2e-3, optimizer="adamw", weight_decay=0.01, exits="auto", vocab_size=200,
                         max_length=16, device="cpu")  # fmt: skip
    Trainer(config, run).fit()
    return run


def test_without_a_dev_file_validation_is_carved_from_train(tmp_path):
    _write(tmp_path / "train.tsv", _sentences(400, 0), column="sentence")
    _write(tmp_path / "test.tsv", _sentences(80, 2))
    splits = load_dataset("textfolder", tmp_path, val_fraction=0.1, text=TextOptions(max_length=12, vocab_size=200))
    assert splits.dev is None and len(splits.train) == 360 and len(splits.val) == 40 and len(splits.test) == 80
    assert not set(splits.train.indices.tolist()) & set(splits.val.indices.tolist())


def test_a_text_folder_loads_as_token_ids(text_root):
    splits = load_dataset("textfolder", text_root, text=TextOptions(max_length=12, vocab_size=200))
    info = splits.info
    assert info.modality == "text" and info.num_classes == 2 and info.max_length == 12
    assert info.input_shape == (12,)
    assert splits.train.images.dtype == torch.int64 and splits.train.images.shape[1] == 12
    assert (splits.train.images[:, 0] == 2).all()  # every sentence starts with [CLS]
    # the dev file is the validation split (drawn like the test); the whole train file is trained on
    assert len(splits.train) == 400 and len(splits.val) == len(splits.dev) == 60 and len(splits.test) == 80
    assert torch.equal(splits.val.images, splits.dev.images) and torch.equal(splits.val.labels, splits.dev.labels)
    cut = dict(info.truncated)
    longest = max(len(t.split()) for _, t in _sentences(400, 0))
    assert cut["train"] > 0 and longest + 1 > 12  # some sentences were longer than 12 tokens, and were counted
    assert splits.tokenizer is not None and json.loads(splits.tokenizer)["model"]["type"] == "WordPiece"
    again = load_dataset("textfolder", text_root, text=TextOptions(max_length=12, tokenizer=splits.tokenizer))
    assert torch.equal(again.test.images, splits.test.images) and again.info.tokenizer == info.tokenizer


def test_text_batches_are_trimmed_and_bucketed(text_root):
    splits = load_dataset("textfolder", text_root, text=TextOptions(max_length=16, vocab_size=200))
    loader = make_loader(splits.train, splits.info, batch_size=16, train=True, seed=3)
    seen, spreads = [], []
    for ids, labels in loader:
        lengths = ids.ne(0).sum(1)
        assert ids.shape[1] == int(lengths.max())  # trimmed to the batch's longest sentence
        spreads.append(int(lengths.max() - lengths.min()))
        seen.append(labels)
    assert sum(len(s) for s in seen) == len(splits.train)
    again = [labels for _, labels in make_loader(splits.train, splits.info, batch_size=16, train=True, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(seen, again))  # the order depends on (seed, epoch) only
    assert np.mean(spreads) <= 2  # grouped by length: little padding inside a batch
    ids, _ = next(iter(make_loader(splits.test, splits.info, batch_size=80, train=False)))
    assert torch.equal(ids, splits.test.images[:, : ids.shape[1]])  # evaluation keeps the order


@pytest.mark.parametrize("name", ["mobilebert_tiny", "bert_mini", "ngram_encoder", "hf_bert", "hf_mobilebert"])
@pytest.mark.parametrize("head", ["pool", "linear", "conv"])
def test_padding_changes_no_answer(name, head):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = attach_exits(create_model(name, num_classes=3, vocab_size=300, max_length=20), "auto", head=head).eval()
    short = torch.tensor([[2, 17, 45, 9]])
    padded = torch.tensor([[2, 17, 45, 9, 0, 0, 0], [2, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        alone, together = model(short), model(padded)
        assert torch.allclose(alone[:, 0], together[:, 0], atol=1e-5)
        for k in range(model.num_steps):
            assert torch.allclose(model.forward_until(short, k)[0], together[k, 0], atol=1e-5)
    assert model.num_steps == len(model.backbone.stages)


def test_text_models_and_data_must_match(text_root, tmp_path):
    from anytime.train import TrainConfig, Trainer

    with pytest.raises(AnytimeError, match="text model"):
        Trainer(TrainConfig(model="lenet", data="textfolder", data_root=str(text_root), epochs=1), tmp_path / "a").fit()
    with pytest.raises(AnytimeError, match="image"):
        Trainer(TrainConfig(model="mobilebert_tiny", data="digits", epochs=1), tmp_path / "b").fit()
    with pytest.raises(AnytimeError, match="early exits"):
        Trainer(TrainConfig(model="mobilebert_tiny", data="textfolder", data_root=str(text_root), epochs=1,
                            slices="0.5,1"), tmp_path / "c").fit()  # fmt: skip
    with pytest.raises(AnytimeError, match="max-length"):
        load_dataset("textfolder", text_root, image_size=32)
    with pytest.raises(AnytimeError, match="for images"):
        Trainer(TrainConfig(model="mobilebert_tiny", data="textfolder", data_root=str(text_root), epochs=1,
                            tta=True), tmp_path / "d").fit()  # fmt: skip
    with pytest.raises(AnytimeError, match="text data"):
        load_dataset("digits", text=TextOptions(max_length=32))


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("text\tlabel2\nhello\t1\n", ["label", "content"]),
        ("label\tcontent\nfine movie\tpositive\n", ["fine movie", "not an integer", ":2"]),
        ("label\tcontent\n", ["no labelled sentence"]),
        ("", ["empty"]),
    ],
)
def test_malformed_tables_are_one_line(tmp_path, content, words):
    path = tmp_path / "train.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(AnytimeError) as caught:
        read_table(path)
    message = str(caught.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_blank_lines_are_counted_and_an_encoding_is_named(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("label\tcontent\n1\tgood\n\n0\t   \n0\tbad\n", encoding="utf-8")
    table = read_table(path)
    assert table.texts == ("good", "bad") and table.empty == 2
    path.write_bytes("label\tcontent\n1\tcaf\u00e9 cr\u00e8me\n".encode("latin-1"))
    with pytest.raises(AnytimeError, match="not UTF-8"):
        read_table(path)


def test_the_pipeline_runs_on_text(text_run, capsys, tmp_path):
    from anytime.cli import main

    summary = json.loads((text_run / "summary.json").read_text())
    assert len(summary["exits"]) == 6 and (text_run / TOKENIZER_FILE).is_file()
    for split in ("val", "dev", "test"):
        assert main(["collect", str(text_run), "--split", split]) == 0
    assert main(["sweep", str(text_run)]) == 0
    assert main(["calibrate", str(text_run), "--max-drop", "1"]) == 0
    assert main(["evaluate", str(text_run), "--split", "dev", "--latency-samples", "0"]) == 0
    capsys.readouterr()
    report = json.loads((text_run / "evaluation-dev.json").read_text())
    assert report["samples"] == 60 and report["agreement_with_cache"]["predictions"] == 1.0
    assert report["agreement_with_cache"]["exits"] == 1.0
    patience = str(tmp_path / "calibration-patience.json")
    assert main(["calibrate", str(text_run), "--max-drop", "2", "--criterion", "patience", "--out", patience]) == 0
    assert (
        main(["evaluate", str(text_run), "--split", "test", "--calibration", patience, "--latency-samples", "5"]) == 0
    )
    capsys.readouterr()
    report = json.loads((text_run / "evaluation-test.json").read_text())
    assert report["agreement_with_cache"] == {"exits": 1.0, "predictions": 1.0}
    assert report["latency"]["early_exit"]["count"] == 5


@pytest.mark.parametrize("precision", ["int8-dynamic", "bf16"])
def test_a_text_run_quantizes_and_goes_through_the_pipeline(text_run, precision, tmp_path, capsys):
    from anytime.cli import main
    from anytime.train.runs import load_run

    out = tmp_path / precision
    assert main(["quantize", str(text_run), "--precision", precision, "--no-compile", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["precision"]["precision"] == precision and len(summary["exits"]) == 6
    for exit_ in summary["exits"]:  # 80 test sentences: 4 of them may change their answer
        assert abs(exit_["test_acc"] - exit_["parent_test_acc"]) <= 0.05, exit_
    assert (out / TOKENIZER_FILE).read_bytes() == (text_run / TOKENIZER_FILE).read_bytes()
    loaded = load_run(out)
    sentence = torch.tensor([[2, 5, 9, 11, 7]])
    with torch.no_grad():
        logits = loaded.model.forward_until(sentence, 5)
    assert logits.dtype == torch.float32 and logits.shape == (1, 2)
    parent_profile = tmp_path / "parent-T8.json"
    for argv in (["collect", out], ["collect", out, "--split", "test"], ["calibrate", out, "--max-drop", "1"],
                 ["evaluate", out, "--split", "test", "--latency-samples", "5"],
                 ["profile", out, "--length", "8", "--batch-sizes", "1", "--repeats", "20", "--no-memory"],
                 ["profile", text_run, "--length", "8", "--batch-sizes", "1", "--repeats", "20", "--no-memory",
                  "--out", parent_profile]):  # fmt: skip
        assert main([str(a) for a in argv]) == 0, argv
    capsys.readouterr()
    report = json.loads((out / "evaluation-test.json").read_text())
    assert report["agreement_with_cache"]["predictions"] >= 0.95  # one by one against the cached batches
    (profiled,) = out.glob("profile-*-T8.json")  # an 8-token sentence costs what 8 tokens cost, not 16

    def flops_of(path):
        return [step["flops"] for step in json.loads(path.read_text())["steps"]]

    flops = flops_of(profiled)
    assert flops == flops_of(parent_profile) and flops[-1] < summary["step_flops"][-1]


def test_static_int8_of_a_text_run_is_refused_in_one_line(text_run, tmp_path, cli_error):
    cli_error(["quantize", str(text_run), "--precision", "int8", "--out", str(tmp_path / "q")], "int8-dynamic")
    assert not (tmp_path / "q").exists()


def test_text_runs_of_one_tokenizer_make_an_ensemble_that_goes_through_the_pipeline(text_run, text_root, tmp_path,
                                                                                      capsys, cli_error):  # fmt: skip
    from anytime.cli import main
    from anytime.train import TrainConfig, Trainer

    second = tmp_path / "bert"
    recipe = dict(data="textfolder", data_root=str(text_root), epochs=1, batch_size=32, lr=2e-3, optimizer="adamw",
                  vocab_size=200, max_length=16, device="cpu")  # fmt: skip
    Trainer(TrainConfig(model="bert_mini", tokenizer=str(text_run / TOKENIZER_FILE), **recipe), second).fit()
    out = tmp_path / "ensemble"
    assert main(["ensemble", "--members", f"{text_run},{second}", "--folds", "2", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["members"]) == 2 and set(report["test_acc"]) == {"mlp", "mean", "vote", "weighted"}
    assert (out / TOKENIZER_FILE).read_bytes() == (text_run / TOKENIZER_FILE).read_bytes()
    for argv in (["calibrate", out, "--max-drop", "1"], ["evaluate", out, "--split", "test", "--latency-samples", "5"],
                 ["profile", out, "--length", "8", "--batch-sizes", "1", "--repeats", "20", "--no-memory"]):  # fmt: skip
        assert main([str(a) for a in argv]) == 0, argv
    capsys.readouterr()
    (profiled,) = out.glob("profile-*-T8.json")
    built = json.loads((out / "summary.json").read_text())["exits"]
    assert json.loads(profiled.read_text())["steps"][-1]["flops"] < built[-1]["flops"]  # counted at 8 tokens, not 16
    evaluation = json.loads((out / "evaluation-test.json").read_text())
    assert evaluation["samples"] == 80 and evaluation["agreement_with_cache"]["predictions"] >= 0.95
    from anytime.data.inputs import TextSpec
    from anytime.train.runs import run_config
    from anytime.train.splits import run_tokenizer

    assert (
        TextSpec.from_tokenizer(run_tokenizer(out), run_config(out)[1], out).max_length == 16
    )  # what `anytime serve` reads first
    other = tmp_path / "own-tokenizer"  # a tokenizer of its own: other token ids for the same words
    Trainer(TrainConfig(model="bert_mini", **{**recipe, "vocab_size": 150}), other).fit()
    cli_error(
        ["ensemble", "--members", f"{text_run},{other}", "--out", str(tmp_path / "e2")], "encode sentences differently"
    )


def test_patience_counts_agreeing_exits_in_a_row():
    from anytime.calibrate.criteria import agreement_streak

    classes = torch.tensor([[0, 1, 2], [0, 1, 0], [0, 0, 0], [1, 0, 0]])  # [K=4 exits, N=3 samples]
    logits = torch.nn.functional.one_hot(classes, 3).double()
    assert agreement_streak(logits).tolist() == [[0, 0, 0], [1, 1, 0], [2, 0, 1], [0, 1, 2]]
    policy = ExitPolicy("patience", (None, 1.0, 2.0))
    with pytest.raises(AnytimeError, match="patience"):
        policy.leaves(1, logits[1])


def test_patience_early_exit_matches_its_offline_assignment():
    from anytime.calibrate.criteria import agreement_streak

    torch.manual_seed(1)
    model = attach_exits(create_model("bert_mini", num_classes=3, vocab_size=200, max_length=12), "auto").eval()
    ids = torch.randint(4, 200, (40, 12))
    ids[::3, 7:] = 0  # some padding
    with torch.no_grad():
        logits = model(ids)
    policy = ExitPolicy("patience", (None, 1.0, 1.0))
    out = policy.run(model, ids)
    predicted = logits.argmax(-1)
    for n in range(40):
        k = int(out.exits[n])
        assert out.predictions[n] == predicted[k, n]
        if k < 3:
            assert k >= 1 and predicted[k, n] == predicted[k - 1, n]  # left on a streak of 1
    streaks = agreement_streak(logits[:-1]).T.tolist()  # [N, K-1]
    expected = [next((k for k in (1, 2) if row[k] >= 1), 3) for row in streaks]
    assert out.exits.tolist() == expected


def test_length_buckets_price_each_request(text_run, tmp_path, capsys):
    from anytime.cli import main
    from anytime.scheduler import AnytimeRunner
    from anytime.scheduler.runs import runner_for_run

    run = tmp_path / "run"
    shutil.copytree(text_run, run, ignore=shutil.ignore_patterns("profile-*"))
    assert main(["profile", str(run), "--length", "8", "--batch-sizes", "1", "--repeats", "100", "--no-memory"]) == 0
    capsys.readouterr()
    assert main(["schedule", str(run), "--deadline-ms", "50", "--length", "12"]) == 2
    assert "longer than every profiled length" in capsys.readouterr().err
    assert main(["profile", str(run), "--length", "16", "--batch-sizes", "1", "--repeats", "100", "--no-memory"]) == 0
    capsys.readouterr()
    for length, bucket in ((5, 8), (12, 16), (40, 16)):  # 40 tokens are cut to the run's 16
        assert main(["schedule", str(run), "--deadline-ms", "50", "--length", str(length)]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["profile"].endswith(f"-T{bucket}.json"), answer
    assert main(["schedule", str(run), "--deadline-ms", "50"]) == 2
    assert "--length" in capsys.readouterr().err
    runner, loaded = runner_for_run(run, policy=False)
    assert isinstance(runner, AnytimeRunner) and sorted(runner.length_profiles) == [8, 16]
    assert runner.bucket_of(3) == 8 and runner.bucket_of(9) == 16
    x = torch.tensor([[2, 10, 11, 12, 13]])
    out = runner.predict(x, 10_000.0)  # a budget every step fits: the most accurate one answers
    # (steps of equal accuracy on this tiny run: the cheaper as measured, so compare accuracies, not names)
    best = max(o.accuracy for o in runner.scheduler.options.values())
    chosen = runner.select(x, 10_000.0).option
    assert out.fits and runner.scheduler.options[out.option].accuracy == best
    assert runner.scheduler.options[chosen].accuracy == best
    # A criterion that compares exits runs in the runtime (it was refused): everyone agrees with nobody before exit 0.
    patient = AnytimeRunner(loaded.model, runner.profile, ExitPolicy("patience", (0.0,) * (loaded.num_steps - 1)))
    answer = patient.predict(x, 10_000.0)
    assert answer.predictions.shape == (1,) and answer.exits.tolist() == [0]


def test_a_tokenizer_from_another_run_is_refused(text_run, tmp_path, cli_error):
    from anytime.data.text import train_tokenizer

    run = tmp_path / "run"
    shutil.copytree(text_run, run)
    (run / TOKENIZER_FILE).write_text(train_tokenizer(("other words entirely", "and some more"), 120))
    cli_error(["collect", str(run), "--split", "val"], "tokenizer", str(run))
    (run / TOKENIZER_FILE).unlink()
    cli_error(["collect", str(run), "--split", "dev"], "has no tokenizer.json", str(run))


@pytest.mark.needs_data
def test_sst2_loads_with_its_columns():
    if not (SST2 / "train.tsv").is_file():
        pytest.skip(f"SST-2 not found at {SST2}")
    splits = load_dataset("sst2", SST2, text=TextOptions(max_length=64))
    assert len(splits.train) == 67_349 and len(splits.val) == len(splits.dev) == 872 and len(splits.test) == 1_821
    assert splits.info.classes == ("0", "1")


def test_the_exits_command_shows_a_text_encoder(capsys):
    from anytime.cli import main

    assert main(["exits", "mobilebert_tiny", "--num-classes", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["exits"]
    assert [r["name"] for r in rows] == [f"stages.{i}" for i in range(5)] + ["output"]
    assert rows[0]["shape"] == [64, 256] and rows[-1]["flops"] > rows[0]["flops"]


@pytest.fixture(scope="module")
def text_server(text_run, tmp_path_factory):
    """`anytime serve` of the text run, calibrated and profiled at 8 and 16 tokens."""
    from anytime.cli import main
    from anytime.serve import ServeOptions, build_app
    from tests.test_serve import listening

    run = tmp_path_factory.mktemp("served-text") / "run"
    shutil.copytree(text_run, run, ignore=shutil.ignore_patterns("profile-*", "calibration*.json"))
    for argv in (["collect", str(run)], ["calibrate", str(run), "--max-drop", "1"],
                 *(["profile", str(run), "--length", t, "--batch-sizes", "1,2", "--repeats", "20", "--no-memory"]
                   for t in ("8", "16"))):  # fmt: skip
        assert main(argv) == 0
    app, service = build_app(ServeOptions(run=str(run), max_body_kb=16, quantile=0.9))  # what 20 timings hold
    with listening(app, service) as port:
        yield SimpleNamespace(port=port, run=run, service=service)


def test_serve_answers_sentences_as_the_body_a_form_or_json(text_server):
    from tests.test_serve import _call, _multipart

    sentence = "a lovely warm film"
    body, headers = _multipart({"text": sentence.encode(), "deadline_ms": b"1000"})
    answers = []
    for path, payload, extra in (
        ("/predict?deadline_ms=1000", sentence.encode(), {"Content-Type": "text/plain; charset=utf-8"}),
        ("/predict", json.dumps({"text": sentence, "deadline_ms": 1000}).encode(), {"Content-Type": "application/json"}),
        ("/predict", body, headers),
    ):  # fmt: skip
        status, answer = _call(text_server, "POST", path, payload, extra)
        assert status == 200, answer
        answers.append(answer)
    assert len({a["class"] for a in answers}) == 1 and answers[0]["class"] in (0, 1)
    assert all(a["met"] and a["step_name"] for a in answers)
    status, health = _call(text_server, "GET", "/healthz")
    assert status == 200 and health["length_buckets"] == [8, 16] and "UTF-8" in health["input"]


def test_serve_schedules_a_text_request_by_its_length_bucket(text_server):
    from tests.test_serve import _call

    for query, bucket in (
        ("&length=5", 8),
        ("&length=12", 16),
        ("", 16),
        ("&length=40", 16),
    ):  # 40 tokens are cut to 16
        status, answer = _call(text_server, "GET", f"/schedule?deadline_ms=50{query}")
        assert status == 200 and answer["profile"].endswith(f"-T{bucket}.json"), answer
        assert answer["quantile"] == 0.9  # the server's, which its profiles' 20 timings hold
    status, answer = _call(text_server, "GET", "/schedule?deadline_ms=50&length=0")
    assert status == 400 and "tokens" in answer["error"]


@pytest.mark.parametrize("body,headers,status,words", [
    (b"\xff\xfe broken", {}, 415, "not UTF-8"),
    (b"   ", {}, 400, "empty sentence"),
    (b'{"text": 3, "deadline_ms": 10}', {"Content-Type": "application/json"}, 400, "must be a string"),
    (b'{"text": "fine"', {"Content-Type": "application/json"}, 400, "not valid JSON"),
    (b'["fine"]', {"Content-Type": "application/json"}, 400, "must be an object"),
    (b'{"sentence": "fine", "deadline_ms": 10}', {"Content-Type": "application/json"}, 400, "no 'text' field"),
])  # fmt: skip
def test_serve_refuses_malformed_text_requests_in_one_sentence(text_server, body, headers, status, words):
    from tests.test_serve import _call

    got, answer = _call(text_server, "POST", "/predict?deadline_ms=100", body, headers)
    assert got == status and words in answer["error"] and "\n" not in answer["error"], answer


def test_a_batch_of_sentences_is_padded_and_answers_as_each_alone(text_server):
    from anytime.serve import Request

    service = text_server.service
    short, long = torch.tensor([2, 40, 41]), torch.tensor([2, 50, 51, 52, 53, 54, 55])
    now = service.clock()
    together = service.answer_now([Request(short, 1e6, now), Request(long, 1e6, now)])
    alone = [service.answer_now([Request(x, 1e6, now)])[0] for x in (short, long)]
    assert [a.label for a in together] == [a.label for a in alone] and together[0].batch_size == 2


def test_a_text_server_refuses_another_runs_tokenizer(text_run, tmp_path):
    from anytime.serve import ServeOptions, build_app

    run = tmp_path / "run"
    shutil.copytree(text_run, run, ignore=shutil.ignore_patterns("profile-*"))
    (run / TOKENIZER_FILE).write_text((run / TOKENIZER_FILE).read_text().replace('"[UNK]"', '"[UNK]" ', 1))
    from anytime.cli import main

    assert main(["profile", str(run), "--length", "16", "--batch-sizes", "1", "--repeats", "100", "--no-memory"]) == 0
    with pytest.raises(AnytimeError, match="not the tokenizer"):
        build_app(ServeOptions(run=str(run)))


def _hf_checkpoint(folder: Path, kind: str, text_root: Path, *, base: bool = False) -> Path:
    """A tiny Hugging Face checkpoint saved by save_pretrained, with a tokenizer trained on the text folder."""
    transformers = pytest.importorskip("transformers")
    from anytime.data.text import train_tokenizer

    table = read_table(text_root / "train.tsv")
    tokenizer = train_tokenizer(table.texts, 200)
    folder.mkdir(parents=True)
    (folder / TOKENIZER_FILE).write_text(tokenizer)
    vocab = len(json.loads(tokenizer)["model"]["vocab"])
    torch.manual_seed(1)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=64, num_labels=2)  # fmt: skip
        model = (transformers.BertModel if base else transformers.BertForSequenceClassification)(config)
    else:
        config = transformers.MobileBertConfig(vocab_size=vocab, hidden_size=64, embedding_size=32, true_hidden_size=32,
                                               intra_bottleneck_size=32, num_hidden_layers=2, num_attention_heads=2,
                                               intermediate_size=64, max_position_embeddings=64, num_labels=2)  # fmt: skip
        model = (transformers.MobileBertModel if base else transformers.MobileBertForSequenceClassification)(config)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind,base", [("bert", False), ("mobilebert", True)])
def test_a_hugging_face_checkpoint_starts_a_run_that_rebuilds_without_it(kind, base, text_root, tmp_path, capsys):
    from safetensors.torch import load_file

    from anytime.backbones.hf import hf_encoder, load_checkpoint_weights, read_checkpoint_config
    from anytime.cli import main
    from anytime.train.runs import load_run

    checkpoint = _hf_checkpoint(tmp_path / "checkpoint", kind, text_root, base=base)
    encoder = hf_encoder(kind, num_classes=2, vocab_size=read_checkpoint_config(checkpoint)["vocab_size"],
                         max_length=16, config=read_checkpoint_config(checkpoint))  # fmt: skip
    load_checkpoint_weights(encoder, checkpoint)
    saved = load_file(str(checkpoint / "model.safetensors"))
    key = next(k for k in saved if k.endswith("embeddings.word_embeddings.weight"))
    assert torch.equal(encoder.stem.embeddings.word_embeddings.weight, saved[key])
    run = tmp_path / "run"
    assert main(["train", "--model", f"hf_{kind}", "--init", str(checkpoint), "--data", "textfolder", "--data-root",
                 str(text_root), "--exits", "auto", "--epochs", "1", "--max-length", "16", "--optimizer", "adamw",
                 "--lr", "2e-3", "--batch-size", "32", "--out", str(run), "--no-progress"]) == 0  # fmt: skip
    record = json.loads((run / "config.json").read_text())
    assert record["hf_config"]["model_type"] == kind and record["hf_config"]["num_hidden_layers"] == 2
    assert (run / TOKENIZER_FILE).read_text() == (
        checkpoint / TOKENIZER_FILE
    ).read_text()  # the checkpoint's vocabulary
    shutil.rmtree(checkpoint)  # the run rebuilds from what it recorded
    loaded = load_run(run)
    assert loaded.num_steps == 2 and loaded.model.forward_all(torch.tensor([[2, 30, 31]])).shape == (2, 1, 2)
    capsys.readouterr()
    assert main(["collect", str(run)]) == 0 and main(["calibrate", str(run), "--max-drop", "5"]) == 0


def test_hugging_face_checkpoints_that_do_not_fit_are_refused_in_one_line(text_root, tmp_path, cli_error):
    checkpoint = _hf_checkpoint(tmp_path / "bert", "bert", text_root)
    train = ["train", "--data", "textfolder", "--data-root", str(text_root), "--exits", "auto", "--epochs", "1",
             "--max-length", "16", "--no-progress"]  # fmt: skip
    cli_error([*train, "--model", "hf_mobilebert", "--init", str(checkpoint), "--out", str(tmp_path / "a")],
              "bert model", "hf_mobilebert")  # fmt: skip
    other = tmp_path / "other-vocabulary"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    cli_error(
        [*train, "--model", "hf_bert", "--init", str(other), "--out", str(tmp_path / "b")], "tokens", "--tokenizer"
    )
    pickled = tmp_path / "pickled"
    shutil.copytree(checkpoint, pickled)
    (pickled / "model.safetensors").unlink()
    cli_error([*train, "--model", "hf_bert", "--init", str(pickled), "--out", str(tmp_path / "c")], "model.safetensors")
    gpt = tmp_path / "gpt"
    shutil.copytree(checkpoint, gpt)
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cli_error([*train, "--model", "hf_bert", "--init", str(gpt), "--out", str(tmp_path / "d")], "gpt2")
    assert not any((tmp_path / name).exists() for name in "abcd")
