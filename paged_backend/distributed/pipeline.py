"""Pipeline parallelism: a stage keeps a contiguous run of decoder layers and hands hidden states on.

The whole HF forward still runs on every stage (embeddings, rotary tables and masks are cheap and model-specific),
but layers outside the stage are replaced by pass-throughs that hold no weights. A forward pre-hook on the
stage's first layer swaps in the hidden states received from the previous stage; a forward hook on its last layer
ends the forward of a non-last stage by raising `StageOutput`, so norm and LM head run only on the last stage.
Each stage's KV pool holds only its own layers (`worker.model_worker.StageKVCache`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paged_backend.distributed.state import RankContext
from paged_backend.errors import UnsupportedModel


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers of stage `pp_rank`: an even split, earlier stages taking one more when it does not divide."""
    if pp_size > num_layers:
        raise UnsupportedModel(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} decoder layers; choose at most "
            f"{num_layers}"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class PassThrough(nn.Module):
    """A decoder layer that another stage owns: returns its input."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class StageOutput(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the last layer of a non-last stage to end the forward with its hidden states."""

    def __init__(self, hidden_states: torch.Tensor) -> None:
        super().__init__("stage output")
        self.hidden_states = hidden_states


class PipelineStage:
    """Cuts `model` down to this rank's layers and moves hidden states between stages with send/recv."""

    def __init__(self, ctx: RankContext, model: nn.Module, layers: range, hidden_size: int) -> None:
        self.ctx, self.layers, self.hidden_size = ctx, layers, hidden_size
        self.dtype = model.dtype
        decoder_layers = model.get_decoder().layers
        for index in range(len(decoder_layers)):
            if index not in layers:
                decoder_layers[index] = PassThrough()
        self._incoming: torch.Tensor | None = None
        if not ctx.is_first_stage:
            decoder_layers[layers.start].register_forward_pre_hook(self._take_incoming)
        if not ctx.is_last_stage:
            decoder_layers[layers[-1]].register_forward_hook(self._stop)

    def _take_incoming(self, module, args):
        return (self._incoming, *args[1:])

    @staticmethod
    def _stop(module, args, output):
        raise StageOutput(output)

    def _peer(self, pp_offset: int) -> int:
        return self.ctx.topology.rank(self.ctx.pp_rank + pp_offset, self.ctx.tp_rank)

    def run(self, forward, num_tokens: int) -> torch.Tensor | None:
        """Run `forward()` (the runner's packed forward) as this stage; the last stage returns the logits."""
        group = self.ctx.compute_group
        if not self.ctx.is_first_stage:
            self._incoming = torch.empty(1, num_tokens, self.hidden_size, dtype=self.dtype, device=self.ctx.device)
            dist.recv(self._incoming, src=self._peer(-1), group=group)
        try:
            return forward()
        except StageOutput as output:
            dist.send(output.hidden_states.contiguous(), dst=self._peer(+1), group=group)
            return None
        finally:
            self._incoming = None
