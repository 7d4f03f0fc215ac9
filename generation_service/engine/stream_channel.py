"""StreamChannel: a mixed step's side of the step channel, in the order of the step's work.

A grammar step of a mixed step (mixed_steps.py) is done where the step runs, not by the host
after it: `publish_inputs` (inputs_seq = N, before the forward), `masks` (wait for mask_seq >= N,
then step N's mask rows for the sampler) and `publish_outputs` (the sampled tokens into entry
N's outputs, then outputs_seq = N). On a CUDA device they are queued on the stream with the
forward and the sampler (stream memory operations on the registered region): the host launches
step N+1 before it reads step N, and grammar_service advances on step N's tokens and fills
N+1's masks while the GPU computes N+1's forward, without the engine's host in between. On the
CPU the same writes happen in program order, which is the order of the step's work there.

Either way the host reads a step's tokens and grammar results after outputs_seq = N
(`GrammarLink.wait_gpu`, with its watchdog), exactly as for a decode graph step.
"""
from __future__ import annotations

import torch

from step_channel import StepChannel


class StreamChannel:
    """The views both kinds share: entry N's mask rows (position 0 of each descriptor row),
    output tokens and counts, as int32 tensors over `words` (the region's words)."""

    def __init__(self, channel: StepChannel, words: torch.Tensor) -> None:
        from step_channel.cuda import ring_view
        g = channel.geometry
        self.channel = channel
        self.depth = g.depth
        self._masks = ring_view(words, g, "masks", (g.max_batch, g.max_positions, g.mask_words))[:, :, 0, :]
        self._out_tokens = ring_view(words, g, "out_tokens", (g.max_batch, g.max_positions))[:, :, 0]
        self._out_counts = ring_view(words, g, "out_counts", (g.max_batch,))

    def publish_inputs(self, step: int) -> None:
        """inputs_seq = step: descriptor N is written and step N-1's outputs are (stream order)."""
        raise NotImplementedError

    def masks(self, step: int, num_rows: int) -> torch.Tensor:
        """(num_rows, mask_words) int32: the mask rows of step `step`'s first rows, once
        grammar_service published them."""
        raise NotImplementedError

    def publish_outputs(self, step: int, tokens: torch.Tensor) -> None:
        """One sampled token per row [0, len(tokens)) into entry `step`'s outputs, then
        outputs_seq = step."""
        slot = step % self.depth
        num_rows = tokens.shape[0]
        self._out_tokens[slot, :num_rows].copy_(tokens)
        self._out_counts[slot, :num_rows].fill_(1)
        self._publish("outputs_seq", step)

    def _publish(self, which: str, step: int) -> None:
        raise NotImplementedError


class DeviceStreamChannel(StreamChannel):
    """On a CUDA stream, over the region registered for the device (step_channel/cuda.py): the
    waits and sequence writes are stream memory operations (a write fences system-wide first,
    so the outputs above it are visible before outputs_seq), the mask rows are gathered from
    the mapped host memory into a device buffer that the sampler then reads."""

    def __init__(self, mapped, device: torch.device) -> None:
        super().__init__(mapped.channel, mapped.words())
        self.mapped = mapped
        g = mapped.channel.geometry
        # NOTE: one buffer for every step: steps on one stream are ordered, so step N+1's
        # gather never overwrites rows step N's sampler still reads.
        self._mask_rows = torch.empty(g.max_batch, g.mask_words, dtype=torch.int32, device=device)

    def publish_inputs(self, step: int) -> None:
        self._publish("inputs_seq", step)

    def masks(self, step: int, num_rows: int) -> torch.Tensor:
        from step_channel.cuda import WAIT_GEQ
        self.mapped.wait_value32(None, "mask_seq", step, WAIT_GEQ)
        rows = self._mask_rows[:num_rows]
        rows.copy_(self._masks[step % self.depth, :num_rows])
        return rows

    def _publish(self, which: str, step: int) -> None:
        self.mapped.write_value32(None, which, step)


class HostStreamChannel(StreamChannel):
    """On the host (a CPU device): the region's own memory, waits under the link's watchdog (a
    lost grammar_service releases the step as the watchdog releases a GPU's: all-ones masks)."""

    def __init__(self, link) -> None:
        from step_channel.cuda import host_words
        super().__init__(link.channel, host_words(link.channel))
        self.link = link

    def publish_inputs(self, step: int) -> None:
        self._publish("inputs_seq", step)

    def masks(self, step: int, num_rows: int) -> torch.Tensor:
        self.link.wait_or_release(step)
        return self._masks[step % self.depth, :num_rows].clone()

    def _publish(self, which: str, step: int) -> None:
        self.channel.publish_seq(which, step)
