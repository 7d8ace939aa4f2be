"""``python -m execserver.client.cli``: the ``exec-server-client`` command."""

from execserver.client.cli import main

main()
