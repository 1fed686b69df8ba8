"""User-facing errors: raised for bad input (a missing model file, a bad flag value, ...).

The CLI and the server turn a `PyptoError` into a clear message and a non-zero exit code or
a 4xx response; anything else escaping is a bug.
"""


class PyptoError(Exception):
    """An error caused by the user's input, with a message fit to show them as is.

    `param` names the offending input (a request field or a flag) when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(PyptoError):
    """The model directory or file cannot be used (missing, corrupt, unsupported)."""


class RequestRejectedError(PyptoError):
    """A request whose own constraints left no token to sample once it was running (its
    allowed_token_ids, bad_words, min_tokens or structured output rule out every token):
    its input's fault, answered 400, not the engine's."""


class RequestFailedError(RuntimeError):
    """A request lost to a fault of the engine (a worker died or hung), not to its input.

    The server answers 503 with `code`; the message names the fault, never a file path."""

    code = "worker_failed"


class EngineDeadError(RequestFailedError):
    """The engine loop stopped (a step raised or hung, or the server is shutting down)."""

    code = "engine_dead"
