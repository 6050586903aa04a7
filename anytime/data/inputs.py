"""What ``POST /predict`` accepts: a PNG or JPEG image, or an ``.npy`` array, turned into the model's input; for a
text run, a sentence in UTF-8 turned into token ids.

Images and uint8 arrays are pixels, normalised here with the mean and standard deviation the run was trained
with; a float array is the model's input as the run's data pipeline makes it (already normalised). Nothing
is resized: an input of another size or channel count is refused with what the model takes. Arrays are read
without pickle, and an image's size is checked from its header before its pixels are decoded. A sentence is
tokenized with the run's own tokenizer (``RUN/tokenizer.json``, checked against the one it was trained with) and
cut at the run's maximum length, as in training; it keeps its own length, so it is priced by its length bucket.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from anytime.errors import AnytimeError, BadRequest

if TYPE_CHECKING:
    import numpy as np
    import torch

_NPY_MAGIC = b"\x93NUMPY"
_IMAGE_MODES = {1: ("L", "LA", "I;16", "I"), 3: ("RGB", "RGBA", "P", "CMYK", "YCbCr")}


class Inputs(Protocol):
    """What the server needs of a run's input: ``field`` (the form or JSON field that carries it), the class
    names, a description for error messages, an example to warm up with, and :meth:`decode`."""

    @property
    def field(self) -> str: ...

    @property
    def class_names(self) -> tuple[str, ...] | None: ...

    def describe(self) -> str: ...

    def example(self) -> bytes: ...

    def decode(self, body: bytes) -> torch.Tensor: ...


@dataclass(frozen=True)
class InputSpec:
    """The input a run's model takes: channels, height, width, the normalisation and the class names."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None
    field: str = "image"

    @classmethod
    def from_dataset(cls, dataset: Mapping[str, Any]) -> InputSpec:
        """From a run's recorded dataset description (``config.json``'s ``dataset``)."""
        height, width = (int(v) for v in dataset["image_size"])
        classes = dataset.get("classes")
        return cls(int(dataset["in_channels"]), height, width, tuple(float(m) for m in dataset["mean"]),
                   tuple(float(s) for s in dataset["std"]), tuple(str(c) for c in classes) if classes else None)  # fmt: skip

    def describe(self) -> str:
        """What the model takes, in words."""
        kind = {1: "grayscale", 3: "RGB"}.get(self.channels, f"{self.channels}-channel")
        return f"{self.width}x{self.height} {kind} images"

    def example(self) -> bytes:
        """A mid-grey input of the right shape as ``.npy`` bytes (for warming up; goes through :meth:`decode`)."""
        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, np.full((self.channels, self.height, self.width), 128, dtype=np.uint8), allow_pickle=False)
        return buffer.getvalue()

    def decode(self, body: bytes) -> torch.Tensor:
        """The model's input ``[C, H, W]`` (float32) for one request's bytes; :class:`BadRequest` otherwise."""
        if not body:
            raise BadRequest(f"empty request: send a PNG or JPEG image or an .npy array ({self.describe()})")
        if body.startswith(_NPY_MAGIC):
            return self._from_array(body)
        return self._from_image(body)

    def _from_array(self, body: bytes) -> torch.Tensor:
        import numpy as np

        self._check_array_header(body)
        try:
            array = np.load(io.BytesIO(body), allow_pickle=False)
        except (ValueError, OSError, EOFError):
            raise BadRequest(
                "the .npy array could not be read (truncated, or an object array, which is refused)"
            ) from None
        if array.dtype == np.uint8:
            return self._normalised(self._chw(array, "array"))
        if array.dtype.kind != "f":
            raise BadRequest(f"the .npy array is {array.dtype}; send uint8 pixels or float32 model inputs")
        chw = self._chw(array.astype(np.float32, copy=False), "array")
        if not np.isfinite(chw).all():
            raise BadRequest("the .npy array holds NaN or infinite values")
        import torch

        return torch.from_numpy(np.ascontiguousarray(chw))

    def _check_array_header(self, body: bytes) -> None:
        """Refuse an array whose header declares another size than the model's input, or more data than the body
        holds, before numpy allocates what the header asks for."""
        import numpy as np
        from numpy.lib import format as npy

        stream = io.BytesIO(body)
        try:
            version = npy.read_magic(stream)
            read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
            if read is None:
                raise BadRequest(f".npy format version {version[0]}.{version[1]} is not accepted; save with numpy.save")
            shape, _, dtype = read(stream)
        except (ValueError, OSError, EOFError, SyntaxError, TypeError):
            raise BadRequest("the .npy header could not be read (truncated or malformed)") from None
        if dtype.hasobject:
            raise BadRequest("the .npy array is an object array, which is refused; send uint8 pixels or float32 inputs")
        expected = self.channels * self.height * self.width
        if not all(isinstance(n, int) and n >= 0 for n in shape) or math.prod(shape) != expected:
            raise BadRequest(f"the array has shape {list(shape)}; the model takes {self.describe()} "
                             f"([{self.channels}, {self.height}, {self.width}])")  # fmt: skip
        if len(body) - stream.tell() < expected * np.dtype(dtype).itemsize:
            raise BadRequest("the .npy array could not be read (truncated, or an object array, which is refused)")

    def _from_image(self, body: bytes) -> torch.Tensor:
        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise BadRequest("this server cannot decode images (Pillow is not installed: pip install anytime[serve]); "
                             "send an .npy array", status=415) from None  # fmt: skip
        import numpy as np

        try:
            with warnings.catch_warnings():  # a header declaring a huge image: refused here, not logged
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(body))
            if image.format not in ("PNG", "JPEG"):
                raise BadRequest(f"{image.format} images are not accepted; send PNG, JPEG or .npy", status=415)
            if image.size != (self.width, self.height):
                raise BadRequest(f"the image is {image.size[0]}x{image.size[1]}; the model takes {self.describe()}")
            if image.mode not in _IMAGE_MODES.get(self.channels, ()):
                raise BadRequest(f"the image is {image.mode}; the model takes {self.describe()}")
            pixels = np.array(
                image.convert("L" if self.channels == 1 else "RGB"), dtype=np.uint8
            )  # writable, for torch
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise BadRequest(f"the image's header declares far more pixels than the model takes ({self.describe()})",
                             status=413) from None  # fmt: skip
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            raise BadRequest("the body is neither a readable PNG or JPEG image nor an .npy array", status=415) from None
        return self._normalised(self._chw(pixels, "image"))

    def _chw(self, array: np.ndarray, what: str) -> np.ndarray:
        c, h, w = self.channels, self.height, self.width
        shape = array.shape
        if len(shape) == 4 and shape[0] == 1:
            array, shape = array[0], shape[1:]
        if shape == (c, h, w):
            return array
        if shape == (h, w, c):
            return array.transpose(2, 0, 1)
        if c == 1 and shape == (h, w):
            return array[None]
        raise BadRequest(f"the {what} has shape {list(shape)}; the model takes {self.describe()} "
                         f"([{c}, {h}, {w}] or [{h}, {w}, {c}])")  # fmt: skip

    def _normalised(self, chw: np.ndarray) -> torch.Tensor:
        import numpy as np
        import torch

        from anytime.data.augment import normalize

        return normalize(torch.from_numpy(np.ascontiguousarray(chw))[None], self.mean, self.std)[0]


class TextSpec:
    """A text run's input: a sentence (UTF-8), tokenized with the run's tokenizer and cut at its maximum length."""

    field = "text"

    def __init__(self, tokenizer: Any, max_length: int, class_names: tuple[str, ...] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.class_names = class_names

    @classmethod
    def from_tokenizer(cls, text: str | None, dataset: Mapping[str, Any], run_dir: Any) -> TextSpec:
        """From a text run's tokenizer JSON ``text`` (:func:`anytime.train.splits.run_tokenizer`), refused when
        missing or not the one the run recorded in ``dataset``."""
        from anytime.data.text import parse_tokenizer, tokenizer_sha

        if text is None or tokenizer_sha(text) != dataset.get("tokenizer"):
            raise AnytimeError(f"{run_dir}/tokenizer.json is not the tokenizer {run_dir} was trained with (another "
                               "run's?); put the run's own tokenizer.json back, or train again")  # fmt: skip
        classes = dataset.get("classes")
        return cls(parse_tokenizer(text, f"{run_dir}/tokenizer.json"), int(dataset["max_length"]),
                   tuple(str(c) for c in classes) if classes else None)  # fmt: skip

    def describe(self) -> str:
        """What the model takes, in words."""
        return f"a sentence in UTF-8 (cut at {self.max_length} tokens)"

    def example(self) -> bytes:
        """A sentence long enough to reach the maximum length (for warming up)."""
        return " ".join(["anytime"] * self.max_length).encode()

    def decode(self, body: bytes) -> torch.Tensor:
        """Token ids ``[T]`` (int64, ``[CLS]`` first, at most ``max_length``); :class:`BadRequest` otherwise."""
        import torch

        try:
            sentence = body.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"the body is not UTF-8 text; the model takes {self.describe()}", status=415) from None
        if not sentence.strip():
            raise BadRequest(f"empty sentence: send {self.describe()}")
        ids = self.tokenizer.encode(sentence).ids[: self.max_length]
        return torch.tensor(ids, dtype=torch.int64)
