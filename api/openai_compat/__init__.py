"""The OpenAI API shape on top of the job queue: each request becomes a job like any other.

``requests`` turns an OpenAI request body into a ``JobRequest`` (refusing what Spool cannot
honour), ``served`` answers which model is served from the worker heartbeats, ``chunks`` renders
a job and its log entries as OpenAI objects and stream chunks, and ``detach`` cancels a
foreground job whose streams all went away.
"""
