"""Speculative decoding by DeepSeek-V3's multi-token prediction layer (`"method": "mtp"`).

The MTP layer (`models/deepseek_mtp.py`) at position p reads the target's final hidden state
there and the token at p + 1, and guesses the token at p + 2. So right after a step samples,
every position the step computed has both: the executor hands this module the step's hidden
states (`catch_up`), which runs the layer over each request's computed positions (a prefill
chunk's, a decode's, a verified request's last token and kept drafts), writing the layer's
entries into the request's own pages (the KV store's layer after the target's: cached, tiered
and reloaded with them), and keeps the layer's guess after each request's newest token: the
draft the scheduler gets for the request's next step (`propose`).

With num_speculative_tokens k > 1 the one layer guesses on from its own guesses, as vLLM
chains it: at position p + i it reads its own output at p + i - 1 (where the target's hidden
state is not computed yet) and its i-th guess, and guesses the next token. Those entries lie
past the request's computed tokens, where the next step's verify rows go, and every position
the target computes gets its entry written anew by `catch_up` before any later guess reads
it; so a chain only writes slots of pages the request holds (it ends, shorter, at the last
one's end) and what it leaves there is never read as a real entry.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from pypto_serving.distributed import StepInputs
from pypto_serving.kv.paged_attention import active_step
from pypto_serving.models.deepseek_mtp import DeepseekMTP
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request

if TYPE_CHECKING:
    from pypto_serving.executor.paged import PagedExecutor


class MTPDrafter:
    """The MTP layer's guesses (a `speculative.Proposer`), made as the executor's steps end."""

    def __init__(self, model: DeepseekMTP, k: int = 1) -> None:
        self.model, self.k = model, k
        self._next: dict[str, tuple[int, list[int]]] = {}
        """request id -> (its token count, the guesses after its last token)."""

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = {}
        for request, k in wanted:
            guess = self._next.get(request.request_id)
            if guess is not None and guess[0] == request.num_tokens:
                out[request.request_id] = guess[1][:k]
        return out

    def forget(self, request_id: str) -> None:
        self._next.pop(request_id, None)

    def catch_up(
        self,
        executor: PagedExecutor,
        seqs: list[tuple[Request, int, int]],
        drafts: dict[int, list[int]],
        sampled: dict[str, list[Sampled]],
        hidden: torch.Tensor,
    ) -> None:
        """Run the layer over the positions a step computed whose next token is known now.
        seqs: the step's sequences (request, first position, tokens) in row order, a
        request with drafts as one sequence per row (its first at `drafts`' key); sampled:
        what the step kept for each request; hidden: the target's final hidden states of
        the step's rows."""
        pieces: list[tuple[Request, int, list[int], list[int], bool]] = []
        ends = list(itertools.accumulate(n for _, _, n in seqs))
        b = 0
        while b < len(seqs):
            r, start, n = seqs[b]
            got = sampled.get(r.request_id, [])
            good = list(itertools.takewhile(lambda t: t.error is None, got))
            if b in drafts:  # its last token and the drafts kept, the sample after each
                rows = [ends[b + i] - 1 for i in range(len(good))]
                following = [t.token_id for t in good]
                at_end = bool(good)
                b += 1 + len(drafts[b])
            else:
                rows = list(range(ends[b] - n, ends[b]))
                following = r.tokens(start + 1, min(start + n + 1, r.num_tokens))
                at_end = len(following) < n and bool(good)
                if at_end:  # the chunk reached its last token: the sample follows it
                    following.append(good[0].token_id)
                rows = rows[: len(following)]
                b += 1
            if rows:
                pieces.append((r, start, rows, following, at_end))
        if not pieces:
            return
        pieces.sort(key=lambda p: len(p[2]) > 1)  # decodes first, as a step's batch has them
        counts = [len(p[2]) for p in pieces]
        dev = hidden.device
        q_lens = torch.tensor(counts, device=dev)
        last = torch.cumsum(q_lens, 0) - 1
        step = StepInputs(
            torch.tensor([t for p in pieces for t in p[3]], device=dev),
            torch.tensor([p[1] + i for p in pieces for i in range(len(p[2]))], device=dev),
            list(executor.kv.pages([p[0].request_id for p in pieces]).values()),
            q_lens,
            torch.tensor([p[1] for p in pieces], device=dev) + q_lens,
            last,
            sum(c == 1 for c in counts),
            max(counts),
        )
        taken = torch.tensor([row for p in pieces for row in p[2]], device=dev)
        out = self._run(executor, step, hidden[taken])
        guesses = [[g] for g in self.model.logits(out[last]).argmax(-1).tolist()]
        ends = [i for i, p in enumerate(pieces) if p[4]]  # guesses following the newest token
        if self.k > 1 and ends:
            self._chain(
                executor,
                [pieces[i][1] + len(pieces[i][2]) - 1 for i in ends],
                [[group[i] for i in ends] for group in step.pages],
                out[last[ends]],
                [guesses[i] for i in ends],
            )
        for (r, start, rows, _, at_end), guess in zip(pieces, guesses, strict=True):
            if at_end:  # its guesses follow the request's newest token
                self._next[r.request_id] = (start + len(rows) + 1, guess)

    def _run(self, executor: PagedExecutor, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output over a step's rows, its entries written as it attends."""
        kind, cfg = executor.model.attention_kind, executor.model.cfg
        attention = kind.step(executor.kv, cfg, executor.batch_of(step))
        with active_step(attention):
            out: torch.Tensor = self.model(
                step.input_ids, step.positions, executor.paged_kv, hidden
            )
        return out

    def _chain(
        self,
        executor: PagedExecutor,
        starts: list[int],
        pages: list[list[list[int]]],
        hidden: torch.Tensor,
        guesses: list[list[int]],
    ) -> None:
        """Guess on, up to k tokens each, for requests whose first guesses were made at
        positions `starts`; pages: theirs, per KV group; hidden: the layer's output there
        [len(starts), hidden]; guesses: each one's list, extended in place. A chain ends
        where its next position would lie past the request's last page."""
        dev = hidden.device
        room = [min(len(g[i]) for g in pages) * executor.kv.page_size for i in range(len(starts))]
        live = list(range(len(starts)))  # the chains going on; hidden's rows are theirs
        for i in range(1, self.k):
            going = [n for n, j in enumerate(live) if starts[j] + i < room[j]]
            if not going:
                return
            live, hidden = [live[n] for n in going], hidden[going]
            at = torch.tensor([starts[j] + i for j in live], device=dev)
            step = StepInputs(
                torch.tensor([guesses[j][-1] for j in live], device=dev),
                at,
                [[group[j] for j in live] for group in pages],
                torch.ones(len(live), dtype=torch.int64, device=dev),
                at + 1,
                torch.arange(len(live), device=dev),
                len(live),
                1,
            )
            hidden = self._run(executor, step, hidden)
            for j, g in zip(live, self.model.logits(hidden).argmax(-1).tolist(), strict=True):
                guesses[j].append(g)
