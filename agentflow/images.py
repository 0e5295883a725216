"""What the system takes as an image, and how images are named and carried.

Screenshots from browser and desktop envs, and the images black-box agents send, are
stored once each as blobs (`agentflow.db.blobs`) named by the SHA-256 of their bytes.
This module is free of database and web code so that `agentflow.types` can validate a
turn's images on construction, and the chat schema can decode data URLs, with one rule:
PNG or JPEG, recognised by their signatures (a claimed media type is never trusted).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from agentflow.errors import InvalidInput

# Media type by leading bytes. Only these: every vision engine decodes them, and a
# signature check keeps arbitrary files out of the store.
SIGNATURES: dict[str, bytes] = {
    "image/png": b"\x89PNG\r\n\x1a\n",
    "image/jpeg": b"\xff\xd8\xff",
}
_BLOB_ID = re.compile(r"[0-9a-f]{64}")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)(?P<params>(;[^,;]*)*?);base64,", re.I)
Field = str | tuple[str, ...]


def image_media_type(data: bytes) -> str | None:
    """`image/png` or `image/jpeg` by signature; None for anything else."""
    for media_type, signature in SIGNATURES.items():
        if data.startswith(signature):
            return media_type
    return None


def blob_id(data: bytes) -> str:
    """The id of a blob: the SHA-256 of its bytes, lower-case hex."""
    return hashlib.sha256(data).hexdigest()


def is_blob_id(value: object) -> bool:
    return isinstance(value, str) and _BLOB_ID.fullmatch(value) is not None


def check_image(data: bytes, field: Field = "images") -> str:
    """The media type of `data`; `InvalidInput` naming `field` unless it is PNG or JPEG."""
    media_type = image_media_type(data)
    if media_type is None:
        raise InvalidInput("an image must be PNG or JPEG bytes", field=field)
    return media_type


def parse_data_url(url: str, *, max_bytes: int, field: Field) -> bytes:
    """The image bytes of a `data:image/png;base64,...` URL (PNG or JPEG, at most
    `max_bytes` decoded). Anything else, network URLs included, is `InvalidInput`: the
    gateway never fetches the network on an agent's behalf."""
    if re.match(r"https?://", url, re.I):
        raise InvalidInput(
            "image URLs are not fetched: send the image inline as a "
            "data:image/png;base64,... or data:image/jpeg;base64,... URL",
            field=field,
        )
    match = _DATA_URL.match(url)
    if match is None:
        raise InvalidInput(
            "an image URL must be a base64 data URL (data:image/png;base64,...)", field=field
        )
    claimed = match.group("type").lower()
    if claimed not in SIGNATURES:
        raise InvalidInput(f"{claimed} is not accepted: send PNG or JPEG", field=field)
    payload = url[match.end() :]
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding
        raise InvalidInput(f"the image is larger than {max_bytes} bytes", field=field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("the image's base64 is malformed", field=field) from None
    if len(data) > max_bytes:
        raise InvalidInput(f"the image is larger than {max_bytes} bytes", field=field)
    if image_media_type(data) != claimed:
        raise InvalidInput(f"the data is not a {claimed} image", field=field)
    return data


def data_url(data: bytes) -> str:
    """`data` (PNG or JPEG) as a base64 data URL, the form vision engines take inline."""
    media_type = check_image(data)
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"
