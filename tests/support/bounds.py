"""Every bound a test asserts about the server's behaviour, in one place.

Each constant is the figure a document promises, and names where: the table
"Promises the tests enforce" in ``docs/performance.md``.
``tests/test_bounds.py`` parses that table and fails if a constant here is
looser than the documented figure, so loosening a bound means changing the
promise in the docs too, visibly.

Waits (how long a test waits for something that must happen) are not
bounds: they are generous timeouts so that a loaded machine cannot fail a
correct server; they live next to the tests.
"""

from __future__ import annotations

MiB = 1 << 20

#: Growth of the server's peak RSS over its idle RSS while a client reads
#: nothing and its processes try to write gigabytes (stdio and WebSocket).
#: The unsent output itself stops at the ~2 MiB high-water mark
#: (docs/protocol.md, "Flow control").
STALL_RSS_GROWTH = 32 * MiB

#: Growth of the server's peak RSS over idle while a WebSocket client keeps
#: sending process/read requests (~1.4 MiB answers) without reading any
#: reply: the server stops reading it once 16 MiB of replies wait
#: (docs/operations.md); measured 30-37 MiB, the replies being held both as
#: messages and as frames while another client streams.
REPLY_BACKLOG_RSS_GROWTH = 48 * MiB

#: Longest pause between another client's process/output notifications
#: while one client reads a 200 MiB file with fs/readFile, as a fraction of
#: the read's duration (request to answer). A fraction, not seconds: the
#: pause and the read slow down together on a loaded machine. A server that
#: read and encoded the file on its event loop would pause for most of the
#: read (0.53-0.56 measured; 0.19-0.26 for this server): docs/performance.md.
FS_READ_PAUSE_FRACTION = 0.4

#: Growth of the server's peak RSS over idle while it answers a whole-file
#: fs/readFile of 128 MiB (stdio and WebSocket), as a multiple of the file:
#: the base64 text (4/3 of the file) exists once, and the transport holds
#: about its high-water mark plus one slice of it (docs/filesystem.md).
FS_READ_FILE_RSS_FACTOR = 1.5

#: Growth of the server's peak RSS over idle while it answers a whole-file
#: fs/readFile or fs/writeFile of 16 MiB, as a multiple of the file (stdio
#: and WebSocket, both methods): the text (1.33x) exists about once, and
#: the rest (read buffer, copies, memory the allocator keeps) is small.
FS_TRANSFER_RSS_FACTOR = 1.5
