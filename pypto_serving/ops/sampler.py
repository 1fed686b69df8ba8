"""The sampler: logits of a batch of rows -> one token per row (plus optional logprobs).

Processing order follows vLLM: penalties, logit_bias, min_tokens (EOS suppressed),
bad_words (the tokens completing one), allowed_token_ids (every other token masked), a
structured output's mask of allowed tokens, then greedy argmax or temperature -> top-k ->
top-p -> min-p -> a draw. Seeded rows draw from their own generator, so a seeded request
samples the same tokens whatever else is in the batch.

A row whose logits hold a NaN or +inf (a numeric fault of the model), or mask every token,
has no token to sample: its Sampled carries an `error` instead, which fails that request
alone (never token 0 from an argmax over NaN); the other rows of the batch are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pypto_serving.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None
    eos_token_ids: Sequence[int] = ()
    allowed: torch.Tensor | None = None
    """A structured output's allowed tokens (grammar.fill_masks: int32 words, bit t % 32 of
    word t // 32 for token t), or None: every token."""


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None
    """The `params.logprobs` most likely tokens and their logprobs (raw model distribution)."""
    error: str | None = None
    """Why no token could be sampled for this row (its logits were unusable): the request
    fails with this message, and token_id means nothing."""
    rejected: bool = False
    """With an error: the model's logits were usable but the request's own constraints
    masked every token (its input's fault, not the engine's)."""
    rank: int | None = None
    """The token's rank in its distribution (1: the most likely), where it was scored
    (prompt logprobs)."""


def edit_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalties (repetition, presence, frequency), logit_bias, min_tokens' suppression of
    stop tokens, bad_words' completing tokens, then allowed_token_ids' mask of every other
    token: a copy of logits with
    those rows edited, or logits itself when no row needs an edit (greedy batches then read
    the raw logits, with no [batch, vocab] copy)."""
    edited = logits
    for i, row in enumerate(rows):
        p = row.params
        occurrence = bool(p.presence_penalty or p.frequency_penalty) and bool(row.output_ids)
        stops = (
            [*p.stop_token_ids, *([] if p.ignore_eos else row.eos_token_ids)]
            if len(row.output_ids) < p.min_tokens
            else []
        )
        banned = banned_by_words(p.bad_words_token_ids, row.output_ids)
        edits = occurrence or stops or p.logit_bias or p.allowed_token_ids or banned
        if p.repetition_penalty == 1.0 and not edits:
            continue
        if edited is logits:
            edited = logits.clone()
        x = edited[i]  # a view: the edits land in `edited`
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted({*row.prompt_ids, *row.output_ids}), dtype=torch.long, device=x.device
            )
            if seen.numel():
                vals = x[seen]
                x[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if occurrence:
            out = torch.tensor(row.output_ids, dtype=torch.long, device=x.device)
            counts = torch.zeros_like(x).scatter_add_(0, out, torch.ones_like(out, dtype=x.dtype))
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=x.device)
            x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
        if stops:
            x[stops] = -float("inf")
        if banned:
            x[banned] = -float("inf")
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=x.device)
            kept = x[allowed]
            x.fill_(-float("inf"))
            x[allowed] = kept
    return edited


def banned_by_words(words: list[list[int]] | None, output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token, where the
    output ends with the rest of it."""
    out: list[int] = []
    for word in words or ():
        head = word[:-1]
        if not head or list(output_ids[len(output_ids) - len(head) :]) == head:
            out.append(word[-1])
    return out


def mask_disallowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf for each token a row's `allowed` mask leaves out (a copy of logits where a row has
    a mask; logits itself where none has)."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not constrained:
        return logits
    words = torch.stack([rows[i].allowed for i in constrained]).to(logits.device)  # type: ignore[misc]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]
    out = logits.clone()
    out[constrained] = logits[constrained].masked_fill(bits == 0, -float("inf"))
    return out


def filter_top_k_top_p_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k / top-p / min-p excludes."""
    vocab = logits.shape[-1]
    dev = logits.device
    top_k = torch.tensor(
        [r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev
    )
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, -float("inf")).softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # keep the first token always
    drop |= probs < min_p[:, None] * probs[:, :1]
    return logits.masked_fill(drop.scatter(1, order, drop), -float("inf"))


def draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row by the exponential race: argmax(p / E), E ~ Exp(1) per token."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
    for i, row in enumerate(rows):  # seeded rows: CPU generators, identical on every device
        if row.generator is not None:
            cpu = torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(
                generator=row.generator
            )
            noise[i] = cpu.to(probs.device)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sampled]:
    """Pick one token for each row of logits [B, vocab] (float32)."""
    raw = logits
    logits = mask_disallowed(edit_logits(logits, rows), rows)
    best, tokens = logits.max(dim=-1)  # NaN where a row holds one, +inf where it holds one
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub = [rows[i] for i in random_rows]
        temps = torch.tensor([r.params.temperature for r in sub], device=logits.device)
        # shifted so each row's best logit is 0: no temperature >= GREEDY_BELOW overflows it
        shifted = (logits[random_rows] - best[random_rows, None]) / temps[:, None]
        scaled = filter_top_k_top_p_min_p(shifted, sub)
        tokens[random_rows] = draw(scaled.softmax(dim=-1), sub)
    out = _with_logprobs(raw, tokens, rows)
    for i, usable in enumerate(torch.isfinite(best).tolist()):
        if not usable:
            model = raw[i]  # the model's own logits, before the request's edits
            faulty = bool((model.isnan() | model.isposinf()).any()) or not model.isfinite().any()
            out[i].rejected = not faulty
            out[i].error = _unusable(logits[i], out[i].rejected)
    return out


def scored(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[Sampled]:
    """Each row's logprob of its target token, and its k most likely tokens (prompt
    logprobs: row i's logits, at one prompt position, scored against the next prompt token)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    return [
        Sampled(t, c, dict(zip(ids[:k], vals[:k], strict=True)), rank=r)
        for t, c, r, ids, vals in zip(
            targets,
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_vals.tolist(),
            strict=True,
        )
    ]


def _unusable(logits: torch.Tensor, rejected: bool) -> str:
    """Why no token can be sampled from one row's logits (NaN, +inf, or every token masked:
    `rejected`, by the request's own constraints over finite logits)."""
    if rejected:
        return (
            "no token is left to sample: this request's allowed_token_ids, bad_words, "
            "min_tokens or structured output rule out every token"
        )
    if bool(logits.isnan().any()):
        why = "the model produced NaN logits for this request"
    elif bool(logits.isposinf().any()):
        why = "the model produced infinite logits for this request"
    else:
        why = "every token's logit is -inf for this request"
    log.warning("a request fails: %s", why)
    return f"{why}, so no token could be sampled"


def _with_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[Sampled]:
    want = (
        max((r.params.logprobs or 0) for r in rows)
        if any(r.params.logprobs is not None for r in rows)
        else None
    )
    token_list = tokens.tolist()
    if want is None:
        return [Sampled(t, 0.0, None) for t in token_list]
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(max(want, 1), dim=-1)
    out = []
    for i, row in enumerate(rows):
        k, named = row.params.logprobs, row.params.logprob_token_ids
        if named:  # these tokens' logprobs, the sampled one's first
            values = logprobs[i, named].tolist()
            top = {token_list[i]: chosen[i], **dict(zip(named, values, strict=True))}
        elif k is not None:
            top = dict(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
        else:
            top = None
        out.append(Sampled(token_list[i], chosen[i], top))
    return out
