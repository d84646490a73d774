"""``horovod.torch.compression``: ringcomm_torch's gradient compressors (the same classes)."""

from ringcomm_torch.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]
