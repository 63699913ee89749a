"""The cluster's CURVE keys on Ray (launch/ray/members.py): who may ask the controller
for them, and which members are given a node's public key when `pdserve scale` adds it.

Links and keys: the frontend admits every node (it reads each node's public key); a
prefill node connects to each decode node's KV port naming that node's key, and the
decode node admits it by its key. Nodes of one role never link to each other. A member
reads every key at its start (keys_for), so one Ray is starting again when a node is
added needs them sent only if it read them before that node's keys were made.
"""

from __future__ import annotations

import hmac
import secrets
import time
from typing import Callable

import ray

RETRY_S = 1.0  # how often a member Ray is starting again is asked again


def make_token() -> str:
    """What the controller hands each member it starts, and asks back for keys: no other
    Ray job holds it. NOTE: any Ray job may still read the key files on the controller's
    machine; docs/ray.md says what protects Ray's own channel."""
    return secrets.token_hex(32)


def check_token(given: object, token: str) -> None:
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
        raise PermissionError(
            "the cluster's keys are handed only to the members its controller started"
        )


def needs_key(member_role: str, new_role: str) -> bool:
    """Does a member of member_role read a new node's public key (its links name or admit
    it)? The frontend, and the nodes of the other role."""
    return member_role == "frontend" or member_role != new_role


def send_keys(
    members: dict[str, object],
    roles: dict[str, str],
    new: list[str],
    role: str,
    public: dict[str, bytes],
    has_read: Callable[[str], bool],
    timeout_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """Give the public keys (new: the nodes just placed, of role) to every member whose links
    read them, the frontend last: a new node registers only once the frontend admits it,
    and by then the nodes it links with know its key. A member Ray is starting again is
    asked again until it answers (or timeout_s), unless it read the new keys at its start
    (has_read); one that is gone is skipped. Each said in a line. -> the members missed."""
    deadline = clock() + timeout_s
    targets = [n for n in members if n not in new and needs_key(roles.get(n, "frontend"), role)]
    missed: list[str] = []
    for wave in ([n for n in targets if n != "frontend"], [n for n in targets if n == "frontend"]):
        waiting, said = list(wave), set()
        while waiting:
            refs = {n: members[n].write_keys.remote(public) for n in waiting}
            waiting = []
            for name, ref in refs.items():
                why = _answer(ref, max(deadline - clock(), 0.1))
                if why is None:
                    continue
                if why == "restarting" and has_read(name):
                    say(f"{name} is being started again by Ray; it read the new keys at its start")
                elif why == "restarting":
                    if name not in said:
                        say(
                            f"{name} is being started again by Ray; giving it the new keys once it "
                            f"answers (for up to {max(deadline - clock(), 0):.0f}s)"
                        )
                        said.add(name)
                    waiting.append(name)
                else:
                    say(f"{name} was not given the new keys: {why}")
                    missed.append(name)
            if waiting and clock() >= deadline:
                say(
                    f"{', '.join(waiting)} did not answer in {timeout_s:.0f}s while Ray started "
                    f"them again: not given the new keys (each reads every key at its next start)"
                )
                missed += waiting
                break
            if waiting:
                sleep(RETRY_S)
    return missed


def _answer(ref, timeout_s: float) -> str | None:
    """None once a member took the keys; "restarting"; or why it cannot take them."""
    try:
        ray.get(ref, timeout=timeout_s)
        return None
    except ray.exceptions.ActorUnavailableError:
        return "restarting"
    except ray.exceptions.GetTimeoutError:
        return f"it did not answer in {timeout_s:.0f}s"
    except ray.exceptions.RayActorError as e:
        return f"it is gone ({why_failed(e)})"
    except ray.exceptions.RayError as e:
        return why_failed(e)


def why_failed(e: Exception) -> str:
    """What went wrong inside an actor, without Ray's wrapping (its traceback is in its log)."""
    lines = str(getattr(e, "cause", None) or e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__
