"""DeepEP's ``Config`` and buffer-size hints: pure arithmetic, no memory is reserved.

zbccl's EP needs no pre-sized staging buffer (receive tensors are allocated at their exact
size after the handshake), so these numbers only matter to callers that size a DeepEP
``Buffer`` with them, and to the benchmark, which compares our heap use with what DeepEP
would reserve. The formulas follow DeepEP's ``csrc/config.hpp``: same results for the same
arguments, so ``Buffer(group, cfg.get_nvl_buffer_size_hint(...))`` code runs unchanged.
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError

__all__ = ["Config", "topk_idx_t", "get_low_latency_rdma_size_hint", "dispatch_config", "combine_config",
           "NUM_MAX_NVL_PEERS"]

#: The dtype of ``topk_idx`` tensors (DeepEP's default build: 64-bit).
topk_idx_t = torch.int64
NUM_MAX_NVL_PEERS = 8
_ALIGN = 128
_MAX_TOPK = 128  # DeepEP's kNumMaxTopK / kNumMaxScales in the hints
_SOURCE_META_BYTES = 8


def _align_up(a: int, b: int) -> int:
    return -(-a // b) * b


class Config:
    """DeepEP's performance config: ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``.

    On CPU only ``num_sms`` has a meaning: ``num_sms // 2`` is the number of channels whose
    token ranges make up ``channel_prefix_matrix`` in the dispatch handle. The other fields
    only feed the size hints. The constructor checks what DeepEP's does.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        nvl_s, nvl_r = int(num_max_nvl_chunked_send_tokens), int(num_max_nvl_chunked_recv_tokens)
        rdma_s, rdma_r = int(num_max_rdma_chunked_send_tokens), int(num_max_rdma_chunked_recv_tokens)
        if num_sms < 0 or not 0 < nvl_s < nvl_r or rdma_s <= 0 or rdma_r <= 0:
            raise ZbcclInvalidUsageError(
                f"Config: bad sizes, expected num_sms >= 0 and 0 < nvl_send < nvl_recv, got num_sms={num_sms}, "
                f"nvl_send={nvl_s}, nvl_recv={nvl_r}, rdma_send={rdma_s}, rdma_recv={rdma_r}")
        rdma_r = _align_up(rdma_r, rdma_s)
        if not (rdma_s < rdma_r and rdma_s <= rdma_r // 2):
            raise ZbcclInvalidUsageError(
                f"Config: bad RDMA sizes, expected rdma_send <= rdma_recv / 2, got {rdma_s} and {rdma_r}")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_s, nvl_r
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_s, rdma_r

    @property
    def num_channels(self) -> int:
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP reserves per rank for intranode (NVLink) dispatch/combine with this config."""
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        per = self.num_channels * nvl_ranks
        recv = self.num_max_nvl_chunked_recv_tokens
        n = per * (2 * rdma_ranks + 3) * 4
        n += per * recv * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_TOPK * 4)
        return _align_up(n, _ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP reserves per rank for internode (RDMA) traffic; 0 up to 8 ranks."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        per = self.num_channels * (num_ranks // NUM_MAX_NVL_PEERS)
        recv = self.num_max_rdma_chunked_recv_tokens
        n = per * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += per * recv * 2 * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_TOPK * 4 + 16)
        return _align_up(n, _ALIGN)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """Bytes DeepEP reserves per rank for low-latency mode (two send, two receive, two signal buffers)."""
    tmax, scales = int(num_max_dispatch_tokens_per_rank), int(hidden) // 128
    dmsg = 16 + max(hidden * 2, hidden + scales * 4)
    cmsg = scales * 4 + hidden * 2
    send = max(tmax * dmsg, num_experts * tmax * cmsg)
    recv = max(num_experts * tmax * dmsg, num_experts * tmax * cmsg)
    sig = _align_up(num_experts * 4, _ALIGN)
    total = 2 * send + 2 * recv + 2 * sig
    return (total + _ALIGN) // _ALIGN * _ALIGN


# DeepEP's recommended ``num_max_nvl_chunked_send_tokens`` per rank count (its config tables).
_DISPATCH_SMS = {2: 24, 4: 6, 8: 6, 16: 36, 24: 32, 32: 32, 48: 32, 64: 32, 96: 20, 128: 20, 144: 32, 160: 28}
_COMBINE_SMS = {2: 10, 4: 9, 8: 4, 16: 4, 24: 1, 32: 1, 48: 1, 64: 1, 96: 1, 128: 1, 144: 2, 160: 2}


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended dispatch config (unknown rank counts get the 2-rank values, not an error)."""
    return Config(num_sms, _DISPATCH_SMS.get(num_ranks, 24), 256, 6, 128)


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended combine config (unknown rank counts get the 2-rank values)."""
    return Config(num_sms, _COMBINE_SMS.get(num_ranks, 10), 256, 6, 128)
