"""Exception hierarchy and the checked-call helpers for the CUDA driver and NVRTC."""
from __future__ import annotations


class KvattnError(Exception):
    """Base class of every error kvattn raises on purpose."""


class CudaUnavailableError(KvattnError):
    """No CUDA driver or no CUDA GPU on this machine."""


class CudaError(KvattnError):
    """A CUDA driver call failed: carries the call name and the symbolic CUresult."""

    def __init__(self, call: str, result, detail: str = ""):
        self.call = call
        self.result = result
        name = getattr(result, "name", str(result))
        msg = f"{call} failed: {name}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class CompileError(KvattnError):
    """NVRTC rejected a kernel source: holds the log, the options and the numbered source lines."""

    def __init__(self, name: str, log: str, options, source_excerpt: str):
        self.name = name
        self.log = log
        self.options = list(options)
        self.source_excerpt = source_excerpt
        super().__init__(
            f"NVRTC failed to compile {name}\n--- log ---\n{log}\n--- options ---\n"
            + " ".join(self.options)
            + (f"\n--- source ---\n{source_excerpt}" if source_excerpt else "")
        )
