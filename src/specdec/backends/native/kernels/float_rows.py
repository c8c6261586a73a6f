"""Float matrices read where the file maps them (a GGUF's F32, or F16 where fbgemm is missing):
one fp32 matrix-vector product per activation row, so a row's bits depend neither on the
other rows nor on the thread count; prompts multiply bf16 tiles on one thread."""

from __future__ import annotations

import torch

from specdec.backends.native.kernels.cpu import one_thread_mm

ROW_TILE = 512


class RowwiseLinear(torch.nn.Module):
    """Float weights [N, K] (fp32, or fp16 dequantized a 512-row tile at a time): one fp32
    matrix-vector product per activation row; prompts multiply bf16 tiles on one thread
    (cpu.one_thread_mm), the same bits at any thread count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # [N, K], the file's own tensor
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = weight.shape[0], torch.float32

    def _tiles(self, dtype: torch.dtype):
        for start in range(0, self.out_features, ROW_TILE):
            stop = min(start + ROW_TILE, self.out_features)
            yield start, stop, self.weight[start:stop].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        xf, out = x.float(), torch.empty(x.shape[0], self.out_features)
        if self.weight.dtype == torch.float32:
            for m in range(x.shape[0]):
                torch.mv(self.weight, xf[m], out=out[m])
        else:
            for start, stop, w in self._tiles(torch.float32):
                for m in range(x.shape[0]):
                    torch.mv(w, xf[m], out=out[m, start:stop])
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype)

    def prompt_forward(self, x: torch.Tensor) -> torch.Tensor:
        xb, out = x.to(torch.bfloat16), torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        for start, stop, w in self._tiles(torch.bfloat16):
            one_thread_mm(xb, w.T, out[:, start:stop])  # the same bits at any thread count
        out = out.float() if self.bias is None else out.float() + self.bias
        return out.to(x.dtype)
