"""Stop strings: an answer ends where one of them first appears in its text.

The engine samples tokens, not text, and SGLang runs without a tokenizer here, so the
gateway watches the text itself: while tokens stream in, `StopWatch` decodes them and
aborts the request as soon as a stop string shows; when the answer is back, `stop_cut`
finds the shortest prefix of output tokens whose text holds one. That prefix is what is
recorded (every token in it was sampled by the policy, so its log-probs stay exact),
and the text before the stop string is what the agent gets. Tokens sampled after it,
while the abort was on its way, are dropped: ending there is a stopping rule like an
end-of-turn token, decided by the prefix alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` starts, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_cut(decode: Decode, ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str] | None:
    """`(length, text)`: the fewest output tokens whose text holds a stop string, and the
    text before it; None when no stop string appears."""
    if not stops or first_stop(decode(ids), stops) is None:
        return None
    low, high = 1, len(ids)  # decode(ids[:high]) holds one; find the smallest such high
    while low < high:
        mid = (low + high) // 2
        if first_stop(decode(ids[:mid]), stops) is None:
            low = mid + 1
        else:
            high = mid
    text = decode(ids[:high])
    at = first_stop(text, stops)
    assert at is not None
    return high, text[:at]


@dataclass
class StopWatch:
    """A token observer that calls `abort` once the streamed text holds a stop string."""

    decode: Decode
    stops: Sequence[str]
    abort: Callable[[], None]
    ids: list[int] = field(default_factory=list)
    fired: bool = False

    def __call__(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if self.fired:
            return
        self.ids.extend(ids)
        # Only the tail can hold a new match: a stop string of n characters spans at most
        # 4n byte-level tokens. `stop_cut` checks the whole answer afterwards anyway.
        longest = max(len(s) for s in self.stops)
        tail = self.ids[-(4 * longest + len(ids)) :]
        if first_stop(self.decode(tail), self.stops) is not None:
            self.fired = True
            self.abort()
