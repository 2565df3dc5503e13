"""The cloud notice watcher: a rollout worker on a bare spot VM polls its cloud's instance
metadata service (`cloud_notice`) and, once the VM is to be preempted, takes the same path as
SIGTERM, the notice every engine gives: it raises SIGTERM in its own process, so uvicorn's
shutdown runs the lifespan's `leave_with_notice`.

What to ask and what an answer means is `services.rollout.cloud_notice`; this is the shell that
sends the requests. An error of the metadata service (unreachable, slow, garbage) is logged,
paced, and tried again at the next poll: it never stops the worker. Answers are read up to a
bound, and each poll has a deadline.
"""

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx

from services.infra.retry import brief
from services.rollout.cloud_notice import (
    AWS_TOKEN_TTL_S,
    DEFAULT_BASE_URLS,
    MAX_ANSWER_BYTES,
    Cloud,
    ErrorPace,
    MetadataError,
    Notice,
    Probe,
    TokenRejected,
    aws_action_probe,
    aws_token_probe,
    azure_events_probe,
    azure_name_probe,
    gcp_probe,
    read_aws_action,
    read_aws_token,
    read_azure_events,
    read_azure_name,
    read_gcp_preempted,
)
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
ERROR_LOG_EVERY_S = 60.0  # a metadata service that keeps failing is logged once a minute
TOKEN_RENEW_BEFORE_S = 60.0  # an AWS session token is renewed this long before it expires


def take_the_sigterm_path(notice: Notice) -> None:
    """Leave as on SIGTERM: uvicorn's handler stops the server and the lifespan releases."""
    signal.raise_signal(signal.SIGTERM)


class NoticeWatcher:
    """Polls one cloud's metadata service until a preemption notice comes, then calls
    `on_notice` once and returns."""

    def __init__(
        self,
        s: RolloutSettings,
        on_notice: Callable[[Notice], None] = take_the_sigterm_path,
    ) -> None:
        if s.cloud_notice == "off":
            raise ValueError("cloud_notice is off: there is nothing to watch")
        self.cloud: Cloud = s.cloud_notice
        self.base_url = (s.cloud_notice_url or DEFAULT_BASE_URLS[self.cloud]).rstrip("/")
        self.interval_s = s.cloud_notice_interval_s
        self.timeout_s = s.cloud_notice_timeout_s
        self.on_notice = on_notice
        self.pace = ErrorPace(ERROR_LOG_EVERY_S)
        self.polls = 0
        self._token: str | None = None  # AWS: the session token and when to renew it
        self._token_renew_at = 0.0
        self._vm_name: str | None = None  # Azure: this VM's name, asked once

    async def run_forever(self) -> None:
        log.info("watching %s metadata at %s for a preemption notice", self.cloud, self.base_url)
        # trust_env off: a proxy from the environment must not see the metadata service
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout_s, trust_env=False
        ) as http:
            while True:
                notice = await self.poll_once(http)
                if notice is not None:
                    log.warning("preemption notice from %s", notice.describe(datetime.now(UTC)))
                    self.on_notice(notice)
                    return
                await asyncio.sleep(self.interval_s)

    async def poll_once(self, http: httpx.AsyncClient) -> Notice | None:
        """One poll within its deadline; an error is logged (paced) and counts as no notice."""
        self.polls += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                notice = await self._ask(http)
        except (httpx.HTTPError, MetadataError, TimeoutError) as exc:
            self._failed(exc)
            return None
        self.pace.recovered()
        return notice

    def _failed(self, exc: BaseException) -> None:
        left_out = self.pace.due(time.monotonic())
        if left_out is None:
            return
        reason = brief(exc) or f"no answer within {self.timeout_s}s"
        more = f" ({left_out} more since the last one logged)" if left_out else ""
        log.warning(
            "%s metadata poll failed: %s: %s%s", self.cloud, type(exc).__name__, reason, more
        )

    async def _ask(self, http: httpx.AsyncClient) -> Notice | None:
        if self.cloud == "gcp":
            return read_gcp_preempted(*await self._send(http, gcp_probe()))
        if self.cloud == "azure":
            if self._vm_name is None:
                self._vm_name = read_azure_name(*await self._send(http, azure_name_probe()))
            return read_azure_events(*await self._send(http, azure_events_probe()), self._vm_name)
        try:
            return await self._ask_aws(http)
        except TokenRejected:
            self._token = None  # expired early (the service restarted): one new one, now
            return await self._ask_aws(http)

    async def _ask_aws(self, http: httpx.AsyncClient) -> Notice | None:
        probe = aws_action_probe(await self._aws_token(http))
        return read_aws_action(*await self._send(http, probe))

    async def _aws_token(self, http: httpx.AsyncClient) -> str:
        if self._token is None or time.monotonic() >= self._token_renew_at:
            self._token = read_aws_token(*await self._send(http, aws_token_probe()))
            self._token_renew_at = time.monotonic() + AWS_TOKEN_TTL_S - TOKEN_RENEW_BEFORE_S
        return self._token

    @staticmethod
    async def _send(http: httpx.AsyncClient, probe: Probe) -> tuple[int, bytes]:
        """The status and the body of the answer, read up to MAX_ANSWER_BYTES."""
        async with http.stream(probe.method, probe.path, headers=probe.headers) as resp:
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise MetadataError(f"{probe.path}: answer over {MAX_ANSWER_BYTES} bytes")
            return resp.status_code, bytes(body)
