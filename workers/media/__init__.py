"""The media worker: image parts of jobs, on one diffusers pipeline per process.

``pipeline.py`` loads and calls the pipeline (no Redis); ``runtime.py`` runs parts through the
store and the worker liveness that text workers use; ``tasks.py`` is its Celery app and task;
``tiny.py`` builds the small random pipeline that tests and the default ``spool up`` load.
"""
