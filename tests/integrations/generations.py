"""Comparing P/D generations with a single engine's in the vLLM tests (tokens and top logprobs)."""

from __future__ import annotations

from kvray.integrations.vllm.pd import Generation


def departures(single: list[Generation], pd: list[Generation], tolerance: float) -> list[str]:
    """Where P/D departs from a single engine by more than `tolerance`: a top logprob further
    apart, or a token that differs where the single engine's top two were further apart (not
    a near tie); each generation is compared up to the first token that differs."""
    found = []
    for index, (alone, moved) in enumerate(zip(single, pd, strict=True)):
        assert alone.logprobs is not None and moved.logprobs is not None
        positions = zip(alone.token_ids, moved.token_ids, alone.logprobs, moved.logprobs, strict=False)
        for position, (mine, theirs, my_top, their_top) in enumerate(positions):
            shared = my_top.keys() & their_top.keys()
            worst = max((abs(my_top[token] - their_top[token]) for token in shared), default=float("inf"))
            if worst > tolerance:
                found.append(f"prompt {index} token {position}: logprobs {worst:.2e} apart")
                break
            if mine != theirs:
                first, second = sorted(my_top.values(), reverse=True)[:2]
                if first - second > tolerance:
                    found.append(
                        f"prompt {index} token {position}: {theirs} for {mine} ({first - second:.2e})"
                    )
                break
    return found
