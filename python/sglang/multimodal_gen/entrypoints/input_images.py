"""Input images of an HTTP request (``/v1/images/edits``, ``/v1/videos``' ``input_reference``):
the file parts of a multipart form, or the text of a JSON body (base64, a data URL, a URL of an
allowed host), decoded once with one request's bounds, each error naming the field it came from.

The rules of a file are :mod:`sglang.multimodal_gen.image_inputs`' (formats, bytes, pixels read
from the header, animation, truncation, conversions); here the request's share is added: the
number of images (checked before anything is decoded), one byte budget shared by every image
and the mask, the body limit a route taking images reads with, and the field names (``image``
for one image, ``image[0]``, ``image[1]``, ... for several, ``mask``). Decoding costs CPU time:
routes call :func:`decode_inputs` off the event loop.
"""

from __future__ import annotations

import re

from sglang.multimodal_gen.entrypoints.http_body import MAX_BODY_BYTES, FormFile
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.image_inputs import (
    ImageBudget,
    ImageLimits,
    InputImage,
    decode_image,
    decode_mask,
    image_from_reference,
)

__all__ = ["body_limit", "decode_inputs", "field_names", "http_field"]


def body_limit(limits: ImageLimits, content_type: str) -> int:
    """The largest body of a route taking images (bytes): every image's bytes
    (:attr:`~.ImageLimits.max_request_bytes`) plus room for the other fields
    (:data:`~.http_body.MAX_BODY_BYTES`); a JSON body carries base64, 4/3 of the bytes."""
    if content_type.lower().startswith("multipart/form-data"):
        return limits.max_request_bytes + MAX_BODY_BYTES
    return limits.max_request_bytes * 4 // 3 + MAX_BODY_BYTES


def field_names(field: str, count: int) -> list[str]:
    """How the ``count`` images of ``field`` are named in messages: ``field`` alone for one,
    ``field[0]``, ``field[1]``, ... for several."""
    return [field] if count == 1 else [f"{field}[{i}]" for i in range(count)]


def decode_inputs(
    values: list[str | bytes | FormFile],
    field: str,
    limits: ImageLimits,
    budget: ImageBudget,
    *,
    mask: bool = False,
    max_count: int | None = None,
    model_max: int | None = None,
    allowed_hosts: tuple[str, ...] = (),
) -> tuple[InputImage, ...]:
    """Decode the images one field of a request carries.

    Args:
        values: the files (:class:`~.http_body.FormFile` or bytes) or texts (base64, data URL,
            URL), in order.
        field: the request field, as the client spells it (``image``, ``mask``,
            ``input_reference``).
        limits: the server's bounds; budget: the request's byte count (shared by its fields).
        mask: decode as masks (:func:`~sglang.multimodal_gen.image_inputs.decode_mask`).
        max_count: most images the server takes (``None``: ``limits.max_images``).
        model_max: most images the served model takes (``None``: no bound of its own).
        allowed_hosts: hosts whose URLs may be fetched.

    Returns:
        The decoded images, in order.

    Raises:
        InvalidRequestError: 400 naming ``field`` for too many images (before any is decoded),
            else naming the image at fault (``image[1]``) as the decoders do.
    """
    top = limits.max_images if max_count is None else max_count
    if len(values) > top:
        raise InvalidRequestError(
            f"{field}: {len(values)} images given; this server takes at most {top} per request "
            "(--max-input-images)",
            param=field,
        )
    if model_max is not None and len(values) > model_max:
        raise InvalidRequestError(
            f"{field}: {len(values)} images given; this model takes at most {model_max}",
            param=field,
        )
    out = []
    for name, value in zip(field_names(field, len(values)), values):
        if isinstance(value, str):
            out.append(
                image_from_reference(
                    value, name, limits, budget, mask=mask, allowed_hosts=allowed_hosts
                )
            )
            continue
        data = value.data if isinstance(value, FormFile) else value
        decode = decode_mask if mask else decode_image
        out.append(decode(data, name, limits, budget))
    return tuple(out)


def http_field(e: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """``e`` naming the field as the route's clients spell it: ``names`` maps the engine's
    request field to the HTTP one (``{"mask_image": "mask"}``). The param is renamed; so is the
    field in the message when its name is an identifier of its own (``mask_image``; a plain word
    such as ``image`` is left in the text, where it may be part of a phrase)."""
    http = names.get(e.param or "")
    if http is None:
        return e
    if "_" in e.param:
        e.message = re.sub(rf"\b{re.escape(e.param)}\b", http, e.message)
        e.args = (e.message,)
    e.param = http
    return e
