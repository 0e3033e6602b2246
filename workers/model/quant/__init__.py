"""Quantized weights: formats, decoders and the methods that install them (``quantization=``)."""
