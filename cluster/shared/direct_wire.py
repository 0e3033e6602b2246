"""The direct token stream's wire format, shared by the replica that writes it
(``workers/engine/direct_stream.py``) and the router that reads it
(``router/direct.py``)::

    connection := secret (SECRET_BYTES of ASCII hex) frame*
    frame      := length (FRAME_HEADER: little-endian uint32) pickle([(key, StreamChunk), ...])
"""

from __future__ import annotations

import struct

FRAME_HEADER = struct.Struct("<I")
SECRET_BYTES = 32
MAX_FRAME_BYTES = 64 << 20  # a frame holds one step's chunks for one router
