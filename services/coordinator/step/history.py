"""The run's responses by prompt, kept for the prompt's next turn in the run (a later epoch):
the last few responses to each prompt, which its jobs then draft from (exact speculative
decoding: `core.request_table`, drafts) and which rank its expected length (length-aware
dispatch).

Bounded, as every key of a run (DESIGN.md 5): at most `HISTORY_PROMPTS` prompts, the ones
written last, each with its last `HISTORY_RESPONSES` responses and `HISTORY_TOKENS` tokens in
all. Two keys (`keys.draft_history`: prompt hash -> its responses as msgpack;
`keys.draft_history_order`: prompt hash -> the step that wrote it last), written with the
groups they come from, in the same MULTI (`stage`), trimmed there by a script that pops the
prompts written longest ago past the bound; read once per step as it opens (`read`: one
HMGET of the shard's prompts). Both are scratch keys of the run, deleted with it.

A prompt of two steps in flight at once (max_staleness) keeps the responses of the step
published last; the other's are not kept. Only drafts and the order of jobs depend on it, never
a token.
"""

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import cast

import msgspec
import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.shards import shard_of_prompt
from services.core.request_table import latest_within

# at most 2048 x 2048 tokens in all (~4M: ~8-12 MB as msgpack where token ids pass 127; a
# long-addition prompt keeps its 4 responses of up to ~300 tokens). A prompt's history rides in
# each of its group's jobs (`Job.drafts`), so it is kept short: the group's own siblings are the
# best drafts anyway, and they come on top of it as they finish
HISTORY_PROMPTS = 2048
HISTORY_RESPONSES = 4
HISTORY_TOKENS = 2048
# keys: the history, its order; args: the bound on prompts. Pops the prompts written longest
# ago (lowest step) past the bound, and their responses with them.
_TRIM = """
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[1])
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do redis.call('HDEL', KEYS[1], old[i]) end
  return over
end
return 0
"""
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[list[int]])


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """The field of a prompt: a digest of its tokens (the same prompt in every epoch)."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()


def kept(earlier: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> list[list[int]]:
    """What a prompt keeps of its earlier responses and its new ones: the latest within the
    bounds, oldest first."""
    return latest_within([*earlier, *new], HISTORY_RESPONSES, HISTORY_TOKENS)


class DraftHistory:
    """The history of run `run_id`, for the prompts of one step's table."""

    def __init__(self, r: aioredis.Redis, run_id: str, max_prompts: int = HISTORY_PROMPTS):
        self.r, self.max_prompts = r, max_prompts
        self.key, self.order = keys.draft_history(run_id), keys.draft_history_order(run_id)

    async def read(
        self, prompts: Sequence[Sequence[int]], shard: int = 0, shards: int = 1
    ) -> dict[int, list[list[int]]]:
        """The earlier responses to each of a step's `prompts` of coordinator shard `shard`
        of `shards` (`contracts.shards`) that has any, by prompt index."""
        indexes = [p for p in range(len(prompts)) if shard_of_prompt(p, shards) == shard]
        if not indexes:
            return {}
        fields = [prompt_key(prompts[i]) for i in indexes]
        raw = cast(list[bytes | None], await self.r.hmget(self.key, fields))
        out = {}
        for i, value in zip(indexes, raw, strict=True):
            if value is not None:
                try:
                    out[i] = _DECODER.decode(value)
                except msgspec.DecodeError:
                    continue  # not ours to fail on: a prompt without history drafts nothing
        return out

    def stage(
        self,
        pipe,
        step: int,
        prompts: Sequence[Sequence[int]],
        earlier: Mapping[int, Sequence[Sequence[int]]],
        groups: Mapping[int, Sequence[Sequence[int]]],
    ) -> None:
        """Stage, on the MULTI that publishes them, the responses of `groups` (prompt index ->
        its responses' tokens) after each prompt's `earlier` ones, and the trim."""
        if not groups:
            return
        mapping = {
            prompt_key(prompts[p]): _ENCODER.encode(kept(earlier.get(p, ()), responses))
            for p, responses in groups.items()
        }
        pipe.hset(self.key, mapping=mapping)
        pipe.zadd(self.order, dict.fromkeys(mapping, step))
        pipe.eval(_TRIM, 2, self.key, self.order, self.max_prompts)
