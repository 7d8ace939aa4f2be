"""What the server has only for the Codex CLI's dialect (docs/protocol.md, "Dialects").

The methods and answers the reference's current release adds for Codex,
beyond the process and fs methods every client uses:

- :mod:`~execserver.codex.environment_info`: ``environmentInfo`` (in
  ``initialize``'s result and ``environment/info``) and the capabilities it
  names;
- :mod:`~execserver.codex.environment_config`: ``environmentConfig/read``
  (the executor's Codex configuration), with
  :mod:`~execserver.codex.toml_depth` (the reference's nesting bound) and
  :mod:`~execserver.codex.toml_writer` (its TOML text);
- :mod:`~execserver.codex.capability_discovery`: ``capabilities/discoverV2``
  (installed skills and plugins), with :mod:`~execserver.codex.skill_yaml`
  (their YAML front matter);
- :mod:`~execserver.codex.watch`: ``fs/watchMissing`` and its
  ``fs/missingChanged`` notifications.

The composition root (``execserver.app``) adds their routes; the session
imports nothing from here (``tests/test_import_graph.py``).
"""
