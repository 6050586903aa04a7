"""What ``POST /predict`` accepts: a PNG or JPEG image, or an ``.npy`` array, turned into the model's input.

Images and uint8 arrays are pixels, normalised here with the mean and standard deviation the run was trained
with; a float array is the model's input as the run's data pipeline makes it (already normalised). Nothing
is resized: an input of another size or channel count is refused with what the model takes. Arrays are read
without pickle, and an image's size is checked from its header before its pixels are decoded.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anytime.serve.service import BadRequest

if TYPE_CHECKING:
    import numpy as np
    import torch

_NPY_MAGIC = b"\x93NUMPY"
_IMAGE_MODES = {1: ("L", "LA", "I;16", "I"), 3: ("RGB", "RGBA", "P", "CMYK", "YCbCr")}


@dataclass(frozen=True)
class InputSpec:
    """The input a run's model takes: channels, height, width, the normalisation and the class names."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None

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

        try:
            array = np.load(io.BytesIO(body), allow_pickle=False)
        except (ValueError, OSError, EOFError):
            raise BadRequest("the .npy array could not be read (truncated, or an object array, which is refused)") from None
        if array.dtype == np.uint8:
            return self._normalised(self._chw(array, "array"))
        if array.dtype.kind != "f":
            raise BadRequest(f"the .npy array is {array.dtype}; send uint8 pixels or float32 model inputs")
        chw = self._chw(array.astype(np.float32, copy=False), "array")
        if not np.isfinite(chw).all():
            raise BadRequest("the .npy array holds NaN or infinite values")
        import torch

        return torch.from_numpy(np.ascontiguousarray(chw))

    def _from_image(self, body: bytes) -> torch.Tensor:
        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise BadRequest("this server cannot decode images (Pillow is not installed: pip install anytime[serve]); "
                             "send an .npy array", status=415) from None  # fmt: skip
        import numpy as np

        try:
            image = Image.open(io.BytesIO(body))
            if image.format not in ("PNG", "JPEG"):
                raise BadRequest(f"{image.format} images are not accepted; send PNG, JPEG or .npy", status=415)
            if image.size != (self.width, self.height):
                raise BadRequest(f"the image is {image.size[0]}x{image.size[1]}; the model takes {self.describe()}")
            if image.mode not in _IMAGE_MODES.get(self.channels, ()):
                raise BadRequest(f"the image is {image.mode}; the model takes {self.describe()}")
            pixels = np.array(image.convert("L" if self.channels == 1 else "RGB"), dtype=np.uint8)  # writable, for torch
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
