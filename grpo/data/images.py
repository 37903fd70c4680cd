"""Images of prompt rows: where a registry entry keeps them, one list of references per row, and the check that
every referenced image exists and opens before any model loads.

A reference is what `datasets.Image(decode=False)` stores, {"bytes": b"..." or None, "path": "..." or None}: a file
path (absolute once read: relative paths are resolved against the registry file's folder) or the encoded bytes of
a parquet / save_to_disk column. A row's chat messages mark where each image goes with IMAGE_MARKER, so messages
stay plain strings (the schema every dataset shares) and the images column lines up with the markers in order.
"""
from __future__ import annotations

import io
import os
from typing import Optional

import datasets

from grpo.errors import DatasetError

IMAGE_MARKER = "<|grpo_image|>"
IMAGE_FEATURE = datasets.List({"bytes": datasets.Value("binary"), "path": datasets.Value("string")})


def image_refs(value, folder: Optional[str], where: str) -> list[dict]:
    """The image references in one cell of an image column: a path, a list of paths, a datasets.Image value
    ({"bytes", "path"}), a list of those, or a PIL image; relative paths are joined to `folder`."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    refs = []
    for item in items:
        if isinstance(item, str):
            refs.append({"bytes": None, "path": _absolute(item, folder)})
        elif isinstance(item, (bytes, bytearray)):
            refs.append({"bytes": bytes(item), "path": None})
        elif isinstance(item, dict) and (item.get("bytes") or item.get("path")):
            data = item.get("bytes")
            refs.append({"bytes": bytes(data) if data else None,
                         "path": None if data else _absolute(str(item["path"]), folder)})
        elif hasattr(item, "save") and hasattr(item, "size"):  # a decoded PIL image
            buffer = io.BytesIO()
            item.save(buffer, format="PNG")
            refs.append({"bytes": buffer.getvalue(), "path": None})
        else:
            raise DatasetError(f"{where}: cannot read an image from {str(item)[:80]!r}; give a file path (relative "
                               f"to the registry file), a list of paths, or image bytes (datasets.Image)")
    return refs


def _absolute(path: str, folder: Optional[str]) -> str:
    path = os.path.expanduser(path)
    return os.path.normpath(path if os.path.isabs(path) or folder is None else os.path.join(folder, path))


def describe(ref: dict) -> str:
    """How a message names an image: its path, or its size when it is inline bytes."""
    return ref["path"] if ref.get("path") else f"<{len(ref['bytes'])} bytes of image data>"


def open_image(ref: dict):
    """The image as an RGB PIL image (decoded now)."""
    from PIL import Image

    with Image.open(io.BytesIO(ref["bytes"]) if ref.get("bytes") else ref["path"]) as image:
        return image.convert("RGB")


def image_size(ref: dict) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels."""
    from PIL import Image

    with Image.open(io.BytesIO(ref["bytes"]) if ref.get("bytes") else ref["path"]) as image:
        return image.size


def check_row_images(name: str, source: str, rows: datasets.Dataset, max_images_per_prompt: int) -> None:
    """Every image of every row exists and opens, and no row has more than max_images_per_prompt (DatasetError
    naming dataset, record and path otherwise)."""
    from PIL import Image, UnidentifiedImageError

    for index, (refs, messages) in enumerate(zip(rows["images"], rows["messages"])):
        where = f"dataset '{name}': record {index + 1} of {source}"
        if len(refs) > max_images_per_prompt:
            raise DatasetError(f"{where} has {len(refs)} images, more than --max_images_per_prompt "
                               f"{max_images_per_prompt}; raise it or drop images from that row")
        markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
        if markers != len(refs):
            raise DatasetError(f"{where}: its messages hold {markers} image part(s) for {len(refs)} image(s)")
        for ref in refs:
            if ref.get("path") and not os.path.isfile(ref["path"]):
                raise DatasetError(f"{where}: image not found: {ref['path']}; fix the path (relative paths are "
                                   f"read from the registry file's folder) or drop the row")
            try:
                with Image.open(io.BytesIO(ref["bytes"]) if ref.get("bytes") else ref["path"]) as image:
                    image.verify()  # reads the whole file; catches truncated and corrupt data
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
                raise DatasetError(f"{where}: image {describe(ref)} cannot be read ({type(exc).__name__}: {exc}); "
                                   f"replace the file or drop the row") from None


# ------------------------------------------------------------------------------------------- registry rows
def undecoded(raw: datasets.Dataset, column: Optional[str]) -> datasets.Dataset:
    """`raw` with an image column (datasets.Image, or a list of them) kept as bytes/paths, not decoded to PIL."""
    feature = raw.features.get(column) if column else None
    if isinstance(feature, datasets.Image):
        return raw.cast_column(column, datasets.Image(decode=False))
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.Image):
        return raw.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return raw


def content_text(parts: list, where: str) -> str:
    """A message's list of content parts as one string: text parts as they are, image parts as IMAGE_MARKER."""
    out = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(str(part.get("text") or ""))
        elif kind == "image":
            out.append(IMAGE_MARKER)
        else:
            raise DatasetError(f"{where}: a content part must be {{\"type\": \"text\", \"text\": ...}} or "
                               f"{{\"type\": \"image\", \"image\": <path>}}, got {part!r}")
    return "".join(out)


def row_images(spec, example: dict, index: int, messages: list[dict]) -> list[dict]:
    """The image references of one registry row, in the order of the IMAGE_MARKERs in `messages`.

    image_field: its images go first in the last user message (markers inserted here, in place);
    messages_field: the image parts of the messages, in order.
    """
    where = f"dataset '{spec.name}': record {index + 1} of {spec.source}"
    root = spec.image_root or spec.registry_folder
    refs = []
    if spec.messages_field:
        for message in example[spec.messages_field] or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "image":
                        value = next((part.get(k) for k in ("image", "path", "url") if part.get(k)), None)
                        if value is None:
                            raise DatasetError(f"{where}: an image part names no image; write {{\"type\": "
                                               f"\"image\", \"image\": \"path/to/file.png\"}}")
                        refs += image_refs(value, root, where)
    if spec.image_field:
        field_refs = image_refs(example[spec.image_field], root, where)
        if field_refs:
            users = [m for m in messages if m["role"] == "user"]
            if not users:
                raise DatasetError(f"{where} has images but no user message to put them in")
            users[-1]["content"] = IMAGE_MARKER * len(field_refs) + users[-1]["content"]
        refs += field_refs
    return refs
