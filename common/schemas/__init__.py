"""The schemas the API and the workers share, one module for each kind of thing:

- ``requests``: the job request (``JobRequest``, its parts); ``text`` what a text generation takes,
  ``chat`` the OpenAI-shaped pieces of it, ``checks`` the limits and error types they share;
- ``events``: a job's events and its log entries;
- ``views``: the objects as the API's GET shows them (jobs, batches, worker heartbeats).
"""
