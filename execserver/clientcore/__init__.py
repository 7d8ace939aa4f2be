"""What every exec-server client shares, free of Twisted.

- :mod:`~execserver.clientcore.types`: lenient views of incoming messages and
  the events a client delivers (OutputEvent, GapEvent, ExitedEvent, ...);
- :mod:`~execserver.clientcore.errors`: the exception classes every client
  raises (ExecServerError and its subclasses);
- :mod:`~execserver.clientcore.calls`: request ids and the pending-call map;
  which calls may be repeated after a resume (``after_drop``);
- :mod:`~execserver.clientcore.follow`: the processes a client follows
  (start registration, close and linger, the "pause" acknowledgement, the
  catch-up after a resume), shared by the Twisted and asyncio clients;
- :mod:`~execserver.clientcore.initialize`: the ``initialize`` params;
- :mod:`~execserver.clientcore.ordering`: seq-ordered, at-most-once delivery
  of a process's events across a resumed session;
- :mod:`~execserver.clientcore.transfer`: ranged fs shapes for upload/download;
- :mod:`~execserver.clientcore.resume`: when to stop resuming a dropped session;
- :mod:`~execserver.clientcore.framing`: NDJSON lines in from a local server's
  stdout (and the message size limit), the tail of its stderr.

The wire types themselves are :mod:`execserver.protocol`, shared with the server.
"""
