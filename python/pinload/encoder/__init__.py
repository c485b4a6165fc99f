"""The text-encoder server: ``pinload encoder serve`` (server.py), its client (client.py), and the
diffusers helper that feeds a FLUX or SD3 pipeline's T5 embeddings from it (diffusers.py).
docs/encoder.md. Needs torch, transformers, safetensors; the server also aiohttp and
prometheus_client (``pip install .[encoder]``).
"""

from .client import (EncodeResult, EncoderBadRequestError, EncoderClient, EncoderError,  # noqa: F401
                     EncoderOverloadedError, EncoderServerError, EncoderTimeoutError, EncoderUnavailableError)

__all__ = ["EncoderClient", "EncodeResult", "EncoderError", "EncoderUnavailableError", "EncoderTimeoutError",
           "EncoderBadRequestError", "EncoderOverloadedError", "EncoderServerError", "Encoder", "EncodeSpec"]


def __getattr__(name: str):
    if name in ("Encoder", "EncodeSpec"):  # torch and transformers only when asked for
        from . import model

        return getattr(model, name)
    raise AttributeError(name)
