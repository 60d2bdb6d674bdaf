"""A multi-turn episode's prefill tokens with and without the serving engine's prefix cache (issue 29).

Each of ``--episodes`` episodes runs ``--turns`` assistant turns through
:class:`~torchtpu_rl.episodes.EpisodeRunner` on a :class:`~torchtpu_rl.serving.ServingEngine`
(a randomly initialized Qwen2-shaped model, the tool example's tokenizer and chat template; nothing
downloaded). After each turn the environment answers with a fixed observation, so turn ``t``'s prompt is
the first prompt plus every earlier turn and observation: the conversation so far. With the prefix cache
(``prefix_cache=True``, the default) the engine finds the earlier turns' KV blocks and prefills only the
new tail; without it every turn prefills the whole conversation again. Reported per side: the prefill
tokens the engine computed over all turns, the prefix-hit tokens, the conversation tokens, and the ratio of
prefill tokens without / with the cache (a first call on other problems warms each engine; the second is
reported). Seconds are printed but not compared: the two sides build different program shapes (the
cached side prefills shorter tails) and the side that runs second finds the first side's programs
compiled, so its time says more about compiles than about prefill.

    python benchmarks/bench_multiturn_prefill.py
    python benchmarks/bench_multiturn_prefill.py --episodes 16 --turns 4 --out runs/bench_multiturn.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


class FixedObservationEnv:
    """After every turn: the same observation; never done (the turn limit ends the episode)."""

    def reset(self, row):
        return None

    def step(self, completion):
        return "Check the numbers once more and answer again.", 0.0, False


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import torch

    import torchtpu  # noqa: F401
    import rl_tool_calc as ex
    from torchtpu_rl.episodes import EpisodeRunner, EpisodeSpec
    from torchtpu_rl.protocol import SamplingParams
    from torchtpu_rl.serving import ServingEngine

    rows, _ = ex.make_splits(max(64, 2 * args.episodes), 0, seed=0)
    tok = ex.build_tokenizer(rows)

    def prompts_of(rs):
        return [tok(tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"] for r in rs]

    # the compile call and the measured call run different problems: the measured one finds no blocks of the
    # first in the cache beyond what conversations share (the template's head)
    sets = {"compile": rows[:args.episodes], "timed": rows[args.episodes:2 * args.episodes]}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    spec = EpisodeSpec(tokenizer=tok, env=FixedObservationEnv, max_turns=args.turns, max_context_tokens=240)
    out = {"config": vars(args), "machine_load_1min": os.getloadavg()[0]}
    for side, cache in (("prefix_cache", True), ("no_prefix_cache", False)):
        model = ex.build_model(tok, args.hidden, args.layers, seed=0)
        eng = ServingEngine(model, tok.pad_token_id, max_slots=args.episodes, page_size=args.page_size,
                            kv_pages=args.episodes * (-(-256 // args.page_size)) * 2, prefix_cache=cache)
        runner = EpisodeRunner(spec)
        figures = {}
        for call, rs in sets.items():
            eng.seed = 0
            torch.manual_seed(0)
            t0 = time.perf_counter()
            batch = runner.run(eng, prompts_of(rs), rs, params, 0, reseed=lambda t: setattr(eng, "seed", 7 + t))
            figures = {"seconds": time.perf_counter() - t0, **{k: runner.last_stats.get(k) for k in
                       ("prefill_tokens", "prefix_hit_tokens", "episode_turns", "assistant_tokens",
                        "observation_tokens")},
                       "conversation_tokens": int(batch.prompt_mask.sum() + batch.response_mask.sum())}
            out[f"{side}_{call}"] = figures
        out[side] = figures
    a, b = out["prefix_cache"], out["no_prefix_cache"]
    out["prefill_ratio_without_over_with"] = b["prefill_tokens"] / max(1, a["prefill_tokens"])
    print(json.dumps(out, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
