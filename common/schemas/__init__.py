"""The schemas the API and the workers share, one module for each kind of thing.

- ``requests`` is the job request (``JobRequest`` and its parts). ``text`` holds what a text
  generation takes, ``chat`` the OpenAI-shaped pieces of it, and ``checks`` the limits and error
  types they share.
- ``events`` is a job's events and its log entries
  (docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix).
- ``views`` is the objects as the API's GET shows them (jobs, batches, worker heartbeats).
"""
