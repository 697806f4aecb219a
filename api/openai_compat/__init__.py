"""The OpenAI API's shapes on top of the job queue: each request becomes a job like any other.

``requests`` turns an OpenAI request body into a ``JobRequest`` (refusing what Spool cannot
honour), and ``chunks`` renders a job and its log entries as OpenAI objects and stream chunks.
"""
