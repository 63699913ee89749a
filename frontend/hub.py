"""What the frontend's parts (node_link.py, migrate.py) read and call of the frontend
itself (server.py's Frontend): named here, below all of them, so no part imports the
server that holds it."""

from __future__ import annotations

from typing import Protocol

from common.base.config import FrontendConfig
from common.base.model_spec import ModelSpec
from common.wire.channel import AsyncChannel
from frontend.admission import Admission
from frontend.nodes import NodeRegistry
from frontend.paths import PathChooser
from frontend.request import ClientKey, RequestState
from frontend.router import NodeState


class Hub(Protocol):
    cfg: FrontendConfig
    spec: ModelSpec
    max_model_len: int
    requests: dict[str, RequestState]  # by node id
    nodes: dict[str, NodeState]  # by name
    registry: NodeRegistry
    admission: Admission
    paths: PathChooser
    node_link: AsyncChannel
    clients: AsyncChannel
    outbox: dict | None  # while a TokenBatch is handled: client -> its outputs
    by_client: dict[tuple[ClientKey, str], list[RequestState]]  # a request's choices running

    async def finish(
        self,
        req: RequestState,
        reason: str,
        error: str | None,
        token_ids: list[int] = (),
        is_node_done: bool = False,
        status: int | None = None,
        logprobs: list | None = None,
    ) -> None: ...

    async def reply(self, client: ClientKey, msg, status: int | None = None) -> None: ...

    async def fail_request(self, req: RequestState, error: str, status: int) -> None: ...

    def unroute(self, req: RequestState) -> None: ...

    def wake_dispatch(self) -> None: ...
