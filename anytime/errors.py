"""The one exception type that reaches the user as a one-line message."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type where it has none), to quote inside a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class AnytimeError(Exception):
    """A problem caused by the user's input (a path, a file, a value).

    The CLI prints ``str(error)`` on one line and exits with status 2, with no traceback;
    the message must therefore say what was wrong and what to do about it.
    """


class PeerStopped(AnytimeError):
    """Raised in the other data-parallel processes when process 0 refused to start a run; process 0 has said why,
    so the CLI prints nothing more."""


class BadRequest(AnytimeError):
    """An input the server refuses (answered with a 4xx and this one-sentence message): raised where a request's
    input is decoded, below the server, so it is declared here."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
