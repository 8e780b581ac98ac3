"""A judge served elsewhere: prompts sent to an OpenAI-compatible ``/v1/chat/completions`` endpoint.

Standard library only. Every sample's request is bounded (a timeout per attempt, a deadline per batch, a
fixed number of attempts) and a sample that fails for good comes back as an exception with a one-line
reason, never raised and never a hang. The token is sent as a bearer header and never logged.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from .code_runner import RetryPolicy, backoff_s, retry_after_s
from .judge import one_line
from .user_functions import RewardConfigError

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True, kw_only=True)
class JudgeEndpointConfig:
    url: str
    """The server's base URL (``http://host:port``), ``.../v1``, or the full ``.../v1/chat/completions``."""
    model: str
    """The ``model`` field of each request: the name the server serves the judge under."""
    token_file: str | None = None
    """A file holding the bearer token (read once, stripped); a token passed to the client wins over it."""
    timeout_s: float = 60.0
    """Longest wait for one attempt's connection or read; a timed-out attempt is retried."""
    retries: int = 2
    """Further attempts after the first, on a refused or reset connection, a timeout, HTTP 5xx or 429."""
    backoff_s: float = 1.0
    """Wait before the first retry, doubled (with jitter) before each further one; Retry-After is honoured."""
    deadline_s: float = 300.0
    """Longest a whole batch may take; a sample without a verdict by then fails."""
    concurrency: int = 8
    """Requests in flight at once, across every caller of one client."""
    max_tokens: int = 512
    """The ``max_tokens`` of each request: the longest verdict."""
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise RewardConfigError(f"judge url must start with http:// or https://, got {self.url!r}")
        for name in ("timeout_s", "deadline_s", "concurrency", "max_tokens"):
            if getattr(self, name) <= 0:
                raise RewardConfigError(f"judge {name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.backoff_s < 0 or self.temperature < 0:
            raise RewardConfigError("judge retries, backoff_s and temperature must be >= 0")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        return base + ("/chat/completions" if base.endswith("/v1") else CHAT_COMPLETIONS_PATH)


def read_token(token: str | None, token_file: str | None) -> str | None:
    """``token`` if given, else the stripped content of ``token_file`` (None when neither is)."""
    if token or not token_file:
        return token or None
    try:
        text = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise RewardConfigError(f"judge token file {token_file}: {error}") from None
    if not text:
        raise RewardConfigError(f"judge token file {token_file} is empty")
    return text


class JudgeRequestError(Exception):
    """A sample's judge request failed for good; the message is one line."""


class _Retry(Exception):
    """This attempt failed in a way a later attempt may not (busy, unreachable, timed out)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


class OpenAICompatibleJudge:
    """A :class:`~.judge.JudgeBackend` sending each prompt as one user message to an OpenAI-compatible server."""

    def __init__(self, config: JudgeEndpointConfig, token: str | None = None):
        self.config = config
        self._token = read_token(token, config.token_file)
        self._retry = RetryPolicy(
            max_attempts=config.retries + 1,
            first_backoff_s=config.backoff_s,
            max_backoff_s=max(10.0, config.backoff_s),
        )
        self._executor = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="judge-client")

    def complete(self, prompts: list[str]) -> list[str | Exception]:
        deadline = time.monotonic() + self.config.deadline_s
        futures = [self._executor.submit(self._ask, prompt, deadline) for prompt in prompts]
        wait(futures, timeout=self.config.deadline_s)
        verdicts: list[str | Exception] = []
        for future in futures:
            if future.done() and not future.cancelled():
                verdicts.append(future.result())
            else:
                future.cancel()  # not started yet: never sent; started: its attempt ends at the deadline
                verdicts.append(self._error(f"no verdict within the {self.config.deadline_s:g}s batch deadline"))
        return verdicts

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _ask(self, prompt: str, deadline: float) -> str | Exception:
        body = json.dumps(
            {
                "model": self.config.model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.config.max_tokens,
                "temperature": self.config.temperature,
            }
        ).encode()
        for attempt in range(1, self._retry.max_attempts + 1):
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return self._error(f"no verdict within the {self.config.deadline_s:g}s batch deadline")
            try:
                return self._post(body, min(self.config.timeout_s, remaining_s))
            except _Retry as failure:
                if attempt == self._retry.max_attempts:
                    return self._error(f"{failure} after {attempt} {'try' if attempt == 1 else 'tries'}")
                pause_s = backoff_s(self._retry, attempt, failure.retry_after, random.random())
                if time.monotonic() + pause_s >= deadline:
                    return self._error(f"{failure}; the batch deadline passed before try {attempt + 1}")
                time.sleep(pause_s)
            except JudgeRequestError as error:
                return error
        raise AssertionError("unreachable: the last attempt returns")

    def _post(self, body: bytes, timeout_s: float) -> str:
        """One attempt: the verdict; raises _Retry (try again) or JudgeRequestError (give up)."""
        request = urllib.request.Request(self.config.endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                reply = response.read()
        except urllib.error.HTTPError as error:
            raise self._refusal(error) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            reason = error.reason if isinstance(error, urllib.error.URLError) else error
            raise _Retry(_connection_failure(reason, timeout_s)) from None
        return self._verdict(reply)

    def _verdict(self, reply: bytes) -> str:
        try:
            content = json.loads(reply)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise self._error(f"malformed reply ({type(error).__name__}): {reply[:80]!r}") from None
        if not isinstance(content, str):
            raise self._error(f"reply's message content is {type(content).__name__}, not text")
        return content

    def _refusal(self, error: urllib.error.HTTPError) -> Exception:
        try:
            detail = one_line(error.read()[:200].decode("utf-8", errors="replace"), 120)
        except (OSError, http.client.HTTPException):
            detail = ""
        reason = f"HTTP {error.code}" + (f" ({detail})" if detail else "")
        if error.code == 429 or error.code >= 500:
            return _Retry(reason, retry_after_s(error.headers))
        return self._error(reason)

    def _error(self, reason: str) -> JudgeRequestError:
        return JudgeRequestError(one_line(f"judge endpoint {self.config.endpoint}: {reason}"))


def _connection_failure(reason: object, timeout_s: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError | socket.timeout):
        return f"no answer within {timeout_s:.3g}s"
    if isinstance(reason, ConnectionResetError | http.client.RemoteDisconnected):
        return "connection reset"
    return f"unreachable ({type(reason).__name__}: {reason})"
