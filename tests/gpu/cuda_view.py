"""Zero-copy torch views of raw device addresses (via __cuda_array_interface__)."""

import torch


class _Raw:
    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def bytes_at(addr: int, nbytes: int) -> torch.Tensor:
    return torch.as_tensor(_Raw(addr, nbytes), device="cuda")
