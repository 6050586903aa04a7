"""Text classification data: tables of labelled sentences, a WordPiece tokenizer trained on the training split, and
padded token ids served through the same :class:`~anytime.data.base.Split` as images.

A text split's ``images`` are int64 token ids ``[N, L]``: each row starts with ``[CLS]`` and is padded with
``[PAD]`` (id 0) to ``L``, the dataset's maximum length; a longer sentence is cut to ``L`` tokens and counted
(:attr:`~anytime.data.base.DatasetInfo.truncated`). Batches are trimmed to their longest row.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anytime.data.base import DatasetInfo, DatasetSplits, default_cache_dir, make_split, stratified_pick
from anytime.errors import AnytimeError
from anytime.utils.seed import derive_seed

TEXT_DATASETS: tuple[str, ...] = ("sst2", "textfolder")
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
PAD_ID = 0
CLS_ID = 2
DEFAULT_VOCAB_SIZE = 8000
DEFAULT_MAX_LENGTH = 64
TEXT_COLUMNS: tuple[str, ...] = ("content", "sentence", "text")
LABEL_COLUMN = "label"
TABLE_SUFFIXES: dict[str, str] = {".tsv": "\t", ".csv": ","}
SST2_ROOTS: tuple[str, ...] = ("data/sst2", "../shared/data/sst2")
TOKENIZER_FILE = "tokenizer.json"  # a text run's tokenizer, beside its weights


@dataclass(frozen=True)
class TextTable:
    """The labelled sentences of one file: ``labels`` are the file's integers; ``empty`` lines were skipped."""

    path: Path
    texts: tuple[str, ...]
    labels: np.ndarray
    empty: int


def _split_file(root: Path, name: str) -> Path | None:
    found = [root / f"{name}{suffix}" for suffix in TABLE_SUFFIXES if (root / f"{name}{suffix}").is_file()]
    if len(found) > 1:
        raise AnytimeError(f"{root} holds both {found[0].name} and {found[1].name}; keep one {name} file")
    return found[0] if found else None


def read_table(path: Path) -> TextTable:
    """A TSV or CSV file with a header naming a ``label`` column (integers) and a text column (``content``,
    ``sentence`` or ``text``). Blank lines and rows whose text is empty are skipped and counted."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise AnytimeError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AnytimeError(f"{path} is not UTF-8 text (byte {exc.start} is not); convert it, e.g. "
                           f"`iconv -f latin1 -t utf-8 {path.name}`") from None  # fmt: skip
    delimiter = TABLE_SUFFIXES[path.suffix.lower()]
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting))
    except csv.Error as exc:
        raise AnytimeError(f"{path} is not a readable {path.suffix[1:].upper()} file ({exc})") from None
    if not rows:
        raise AnytimeError(f"{path} is empty; it needs a header line with a {LABEL_COLUMN} and a text column")
    header = [cell.strip().lower() for cell in rows[0]]
    text_columns = [c for c in TEXT_COLUMNS if c in header]
    if LABEL_COLUMN not in header or not text_columns:
        raise AnytimeError(f"{path}: the header names columns {rows[0]}; it needs '{LABEL_COLUMN}' and one of "
                           f"{', '.join(repr(c) for c in TEXT_COLUMNS)}")  # fmt: skip
    label_at, text_at = header.index(LABEL_COLUMN), header.index(text_columns[0])
    texts: list[str] = []
    labels: list[int] = []
    empty = 0
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not cell.strip() for cell in row):
            empty += 1
            continue
        if len(row) <= max(label_at, text_at):
            raise AnytimeError(f"{path}:{line} has {len(row)} column(s), the header {len(header)}; fix that line")
        sentence = row[text_at].strip()
        if not sentence:
            empty += 1
            continue
        try:
            labels.append(int(row[label_at].strip()))
        except ValueError:
            raise AnytimeError(f"{path}:{line}: the label {row[label_at]!r} is not an integer; labels are class "
                               "numbers (0, 1, ...)") from None  # fmt: skip
        texts.append(sentence)
    if not texts:
        raise AnytimeError(f"{path} holds no labelled sentence")
    return TextTable(path, tuple(texts), np.asarray(labels, dtype=np.int64), empty)


def find_text_root(name: str, root: str | os.PathLike[str] | None) -> Path:
    """The folder holding ``train`` and ``test`` tables (and optionally ``dev``)."""
    if root is not None:
        candidates = [Path(root).expanduser()]
    elif name == "sst2":
        candidates = [*([Path(os.environ["ANYTIME_SST2"]).expanduser()] if os.environ.get("ANYTIME_SST2") else []),
                      *(Path(p) for p in SST2_ROOTS)]  # fmt: skip
    else:
        raise AnytimeError("the textfolder dataset needs a root: pass --data-root PATH holding train.tsv and "
                           "test.tsv (or .csv), and optionally dev.tsv")  # fmt: skip
    for candidate in candidates:
        if candidate.is_dir() and _split_file(candidate, "train") is not None:
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise AnytimeError(f"no {name} data found (tried {tried}); pass --data-root PATH holding train.tsv and test.tsv")


def _tokenizers():  # type: ignore[no-untyped-def]
    try:
        import tokenizers
    except ImportError:
        raise AnytimeError("text data needs the tokenizers library: pip install 'anytime[text]'") from None
    return tokenizers


def train_tokenizer(texts: tuple[str, ...], vocab_size: int) -> str:
    """A lower-casing WordPiece tokenizer (BERT's normalisation and pre-tokenisation) trained on ``texts``, as
    JSON; every encoding starts with ``[CLS]``."""
    lib = _tokenizers()
    Tokenizer, models, normalizers = lib.Tokenizer, lib.models, lib.normalizers
    pre_tokenizers, processors, trainers = lib.pre_tokenizers, lib.processors, lib.trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", CLS_ID)])
    return tokenizer.to_str()


def parse_tokenizer(json_text: str, where: str):  # type: ignore[no-untyped-def]
    """A ``tokenizers.Tokenizer`` from its JSON, checked to do what the models expect: ``[PAD]`` is id 0 (the
    encoders find padding by it) and every encoding starts with ``[CLS]``. One ``anytime train`` wrote, or a
    Hugging Face checkpoint's ``tokenizer.json`` (BERT's vocabulary: ``[CLS]`` 101, ``[SEP]`` closing)."""
    lib = _tokenizers()
    try:
        tokenizer = lib.Tokenizer.from_str(json_text)
    except Exception as exc:  # noqa: BLE001  the Rust side raises its own exception type
        raise AnytimeError(f"{where} is not a tokenizer file ({str(exc).splitlines()[0]})") from None
    if tokenizer.token_to_id("[PAD]") != PAD_ID:
        raise AnytimeError(f"{where}: [PAD] must have id {PAD_ID}; use a tokenizer `anytime train` wrote or a BERT one")
    cls = tokenizer.token_to_id("[CLS]")
    if cls is None or tokenizer.encode("a").ids[:1] != [cls]:
        raise AnytimeError(f"{where} does not start its encodings with [CLS]; use a tokenizer `anytime train` wrote "
                           "or a BERT one")  # fmt: skip
    return tokenizer


def tokenizer_sha(json_text: str) -> str:
    """The name of a tokenizer: the SHA-1 of its JSON."""
    return hashlib.sha1(json_text.encode()).hexdigest()


def encode(tokenizer, texts: tuple[str, ...], max_length: int) -> tuple[np.ndarray, int]:  # type: ignore[no-untyped-def]
    """Token ids int64 ``[N, max_length]`` padded with 0, and how many sentences were longer (cut)."""
    ids = np.full((len(texts), max_length), PAD_ID, dtype=np.int64)
    cut = 0
    for row, encoding in enumerate(tokenizer.encode_batch(list(texts))):
        tokens = encoding.ids
        if len(tokens) > max_length:
            cut += 1
            tokens = tokens[:max_length]
        ids[row, : len(tokens)] = tokens
    return ids, cut


def _cached_ids(  # type: ignore[no-untyped-def]
    cache: Path | None, tokenizer, texts: tuple[str, ...], max_length: int
) -> tuple[np.ndarray, int]:
    if cache is not None:
        try:
            with np.load(cache, allow_pickle=False) as stored:
                ids, cut = stored["ids"], int(stored["cut"])
            if ids.shape == (len(texts), max_length) and ids.dtype == np.int64:
                return ids, cut
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass  # absent or damaged: encode again
    ids, cut = encode(tokenizer, texts, max_length)
    if cache is not None:
        from anytime.utils.io import atomic_path

        try:
            with atomic_path(cache) as tmp:
                with open(tmp, "wb") as handle:
                    np.savez(handle, ids=ids, cut=np.int64(cut))
        except AnytimeError:
            pass  # a read-only cache only costs speed
    return ids, cut


def _fingerprint(tables: dict[str, TextTable]) -> str:
    digest = hashlib.sha1()
    for name in sorted(tables):
        table = tables[name]
        digest.update(name.encode())
        digest.update("\n".join(table.texts).encode())
        digest.update(table.labels.tobytes())
    if "dev" in tables:  # validation is the dev file (a run that carved it from train, before, is another run's data)
        digest.update(b"validation=dev")
    return digest.hexdigest()


@dataclass(frozen=True)
class TextOptions:
    """How a text dataset's sentences become token ids (:func:`load_text_dataset`).

    ``vocab_size`` is the number of entries (tokens) of the WordPiece tokenizer trained on the training split (None:
    ``DEFAULT_VOCAB_SIZE``); ``max_length`` the length in tokens every sentence is padded or cut to (None:
    ``DEFAULT_MAX_LENGTH``); ``tokenizer`` the JSON of a tokenizer that encodes the sentences instead of a trained
    one (None: one is trained). All None for image data."""

    vocab_size: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None

    def sizes(self) -> tuple[int, int]:
        """``(vocab_size, max_length)``, defaults filled in; refused when too small to encode a sentence."""
        vocab_size = DEFAULT_VOCAB_SIZE if self.vocab_size is None else self.vocab_size
        max_length = DEFAULT_MAX_LENGTH if self.max_length is None else self.max_length
        if vocab_size < 100:
            raise AnytimeError(f"--vocab-size must be at least 100 tokens (got {vocab_size})")
        if max_length < 2:
            raise AnytimeError(f"--max-length must be at least 2 tokens, [CLS] and one word (got {max_length})")
        return vocab_size, max_length


def load_text_dataset(
    name: str, root: str | os.PathLike[str] | None, *, val_fraction: float, seed: int,
    cache_dir: str | os.PathLike[str] | None, limit_train: int | None, text: TextOptions | None = None,
) -> DatasetSplits:  # fmt: skip
    """Train / validation / test (and dev, where the folder has one) splits of token ids, encoded as ``text`` says
    (default :class:`TextOptions`).

    Where the folder has a dev file, it is the validation split (also named ``dev``) and the whole train file is
    trained on: a dev file is held out and drawn like the test, where a carve of train need not be (SST-2's train
    file holds phrases of its training sentences, its dev and test files whole sentences), and what a run promises
    is measured on validation. Without one, validation is ``val_fraction`` of ``train`` (stratified, seeded, as
    for images). ``text.tokenizer`` (its JSON) encodes the sentences; without one, a WordPiece tokenizer of
    ``text.vocab_size`` entries is trained on the training split and returned in :attr:`DatasetSplits.tokenizer`
    for the run to keep.
    """
    if name not in TEXT_DATASETS:
        raise AnytimeError(f"unknown text dataset {name!r}; choose one of {', '.join(TEXT_DATASETS)}")
    text = text or TextOptions()
    vocab_size, max_length = text.sizes()
    tokenizer = text.tokenizer
    folder = find_text_root(name, root)
    tables = {split: read_table(path) for split in ("train", "dev", "test")
              if (path := _split_file(folder, split)) is not None}  # fmt: skip
    if "test" not in tables:
        raise AnytimeError(f"{folder} has no test.tsv or test.csv; a text dataset needs labelled train and test files")
    values = np.unique(tables["train"].labels)
    for table in tables.values():
        unknown = np.setdiff1d(np.unique(table.labels), values)
        if unknown.size:
            raise AnytimeError(f"{table.path} has label(s) {unknown.tolist()} that the training file never uses")
    train_labels = np.searchsorted(values, tables["train"].labels)
    if "dev" in tables:
        val_rel, train_idx = None, np.arange(len(train_labels), dtype=np.int64)
    else:
        val_rel, train_idx = stratified_pick(
            train_labels, round(val_fraction * len(train_labels)), derive_seed("val", seed)
        )
    if limit_train is not None and limit_train < len(train_idx):
        keep, _ = stratified_pick(train_labels[train_idx], limit_train, derive_seed("limit", seed))
        train_idx = train_idx[keep]
    if tokenizer is None:
        tokenizer = train_tokenizer(tuple(tables["train"].texts[i] for i in train_idx), vocab_size)
    where = "the run's tokenizer"
    parsed = parse_tokenizer(tokenizer, where)
    sha = tokenizer_sha(tokenizer)
    fingerprint = _fingerprint(tables)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    splits = {}
    truncated = []
    for split, table in tables.items():
        path = cache / "text" / f"{fingerprint[:16]}-{sha[:16]}-{split}-L{max_length}.npz"
        ids, cut = _cached_ids(path, parsed, table.texts, max_length)
        truncated.append((split, cut))
        labels = np.searchsorted(values, table.labels)
        if split == "train":
            splits["train"] = make_split("train", ids[train_idx], labels[train_idx], train_idx)
            if val_rel is not None:
                splits["val"] = make_split("val", ids[val_rel], labels[val_rel], val_rel)
        else:
            every = np.arange(len(labels), dtype=np.int64)
            splits[split] = make_split(split, ids, labels, every)
            if split == "dev":
                splits["val"] = make_split("val", ids, labels, every)
    info = DatasetInfo(
        name=name, num_classes=len(values), in_channels=1, image_size=(1, max_length),
        classes=tuple(str(int(v)) for v in values), mean=(0.0,), std=(1.0,), hflip=False, source=str(folder.resolve()),
        fingerprint=fingerprint, modality="text", vocab_size=int(parsed.get_vocab_size()), max_length=max_length,
        tokenizer=sha, truncated=tuple(truncated), empty_lines=tuple((s, t.empty) for s, t in tables.items()),
    )  # fmt: skip
    return DatasetSplits(info=info, train=splits["train"], val=splits["val"], test=splits["test"],
                         dev=splits.get("dev"), tokenizer=tokenizer)  # fmt: skip
