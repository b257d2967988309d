"""`--tensor-parallel-size N`: the engine at TP=1 and TP=N on the same workload in one run, and the share of
the driver's step time spent in collectives (all-reduces, the step broadcast, stage hand-offs), read from
torch.profiler's c10d/gloo/nccl events in a separate profiled TP=N run."""

from __future__ import annotations

import copy
import time

from torch.profiler import ProfilerActivity, profile

from paged_backend.bench.report import markdown_table

COLLECTIVE_KEYS = ("gloo:", "nccl:", "c10d::")


def collective_share(model, prompts, outputs, make_engine, **engine_kwargs) -> tuple[float, float]:
    """(seconds in collectives, wall seconds) of one profiled generate on the driver."""
    llm, params = make_engine(model, prompts, outputs, **engine_kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
    llm.engine.close()
    # Top-level collective events only (a gloo event nests inside its c10d op): take the larger family.
    totals = {key: 0.0 for key in COLLECTIVE_KEYS}
    for event in prof.key_averages():
        for key in COLLECTIVE_KEYS:
            if event.key.startswith(key):
                totals[key] += event.cpu_time_total / 1e6
    return max(totals.values()), wall


def compare_tensor_parallel(base, prompts, outputs, tp_size: int, run_engine, make_engine, **engine_kwargs) -> dict:
    """Output tok/s at TP=1 and TP=`tp_size`, their ratio, and the collective share of TP=`tp_size`'s wall time.
    Each run's rate counts the tokens it produced (`outputs` are only caps when requests end at EOS)."""
    rows, results = [], {}
    for size in (1, tp_size):
        run = run_engine(copy.deepcopy(base), prompts, outputs, tensor_parallel_size=size, **engine_kwargs)
        results[size] = sum(map(len, run.tokens)) / run.elapsed
        rows.append([f"engine TP={size}", f"{run.elapsed:.2f}", f"{results[size]:.1f}"])
    comm, wall = collective_share(copy.deepcopy(base), prompts, outputs, make_engine,
                                  tensor_parallel_size=tp_size, **engine_kwargs)  # fmt: skip
    print(markdown_table(["system", "seconds", "output tok/s"], rows))
    print(f"TP={tp_size} vs TP=1: {results[tp_size] / results[1]:.2f}x; collectives (driver, profiled run): "
          f"{comm:.2f} s of {wall:.2f} s = {100 * comm / wall:.1f}% of wall time")  # fmt: skip
    return {"tok_s": results, "ratio": results[tp_size] / results[1], "collective_share": comm / wall}
