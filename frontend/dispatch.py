"""The request at the head of the line (admission.py: clients take turns) goes to a
prefill/decode pair with room (router.py), by the path paths.py chooses (disaggregated,
or prefilled on its decode node), with its forks (its request's other choices, which
share its prefill) in one PrefillRequest."""

from __future__ import annotations

from common.wire.protocol import Fork, PrefillRequest
from frontend import paths, router
from frontend.request import RequestState


class Dispatcher:
    """fe: the Frontend (server.py): its admission, nodes, requests and node link."""

    def __init__(self, fe):
        self.fe = fe
        self.num_routes: dict[str, int] = {}  # "prefill -> decode" -> requests routed that way

    async def send_next(self) -> bool:
        """Send the request at the head of the line, or fail it where no node can ever
        take it; False when no pair has room for it now (it waits for the next wake)."""
        fe = self.fe
        req = fe.admission.peek()
        ids, params = req.continuation()  # a moved request: its prompt and what it streamed
        can_local = (
            not req.forks and params.num_prompt_logprobs < 0 and not params.is_masked_per_step
        )
        choice = None

        def is_local(prefill, decode, work_tokens, local_tokens) -> bool:
            nonlocal choice
            choice = fe.paths.decide(
                paths.figures(len(ids), work_tokens, local_tokens, prefill, decode),
                decode.name,
                can_local,
            )
            return choice.path == "local"

        num_rows = 1 + sum(f.node_id in fe.requests for f in req.forks)
        route = router.assign(
            fe.nodes,
            fe.cfg.max_queued_tokens,
            ids,
            req.route_keys,
            None if fe.paths.mode == "always" else is_local,
            num_rows,
        )
        if route is None:
            if self._is_too_wide(num_rows):
                # NOTE: it would wait at the head of the line, and everyone behind it
                why = f"no live decode node has the {num_rows} batch rows its n choices need"
                await fe.fail_request(req, why, 503)
                return True
            return False
        fe.admission.next()
        prefill, decode, work_tokens = route
        req.work_tokens = work_tokens
        if choice is None:  # --disaggregate always: not asked
            choice = fe.paths.decide(paths.Figures(len(ids)), decode.name, can_local)
        self._record_path(req, choice, decode.name)
        forks = self._take_forks(req)
        for r in [req, *forks]:
            r.prefill_node = prefill.name
            r.decode_node = decode.name
        for _ in forks:
            router.routed(prefill, decode, 0)
        pair = f"{prefill.name} -> {decode.name}"
        self.num_routes[pair] = self.num_routes.get(pair, 0) + 1 + len(forks)
        if req.moved_at is not None:
            fe.migrations.routed(req, pair)
        await fe.node_link.send(
            PrefillRequest(
                req.node_id,
                ids,
                params,
                req.arrival_time,
                decode.name,
                decode.ready.kv_endpoint,
                [Fork(f.node_id, f.params.seed) for f in forks],
            ),
            to=prefill.identity,
        )
        return True

    def _is_too_wide(self, num_rows: int) -> bool:
        """Whether a pair is live but no decode node has num_rows batch rows."""
        nodes = self.fe.nodes
        return router.choose(nodes) is not None and router.choose(nodes, num_rows=num_rows) is None

    def _record_path(self, req: RequestState, choice: paths.Choice, decode: str) -> None:
        self.fe.paths.record(choice, decode)
        timings = choice.timings()
        if req.num_migrations:  # a moved request keeps its first life's path
            req.timings["path_after_move"] = timings["path"]
        else:
            req.timings.update(timings)

    def _take_forks(self, req: RequestState) -> list[RequestState]:
        """Its forks still running, which go with it; it holds none after."""
        forks = [f for f in req.forks if f.node_id in self.fe.requests]
        req.forks = []
        return forks
