"""The schemas the API and the workers share, one module for each kind of thing:

- ``requests``: the job request (``JobRequest``, its parts); ``text`` what a text generation takes,
  ``chat`` the OpenAI-shaped pieces of it, ``checks`` the limits and error types they share;
- ``events``: a job's events and its log entries;
- ``views``: the objects as the API's GET shows them (jobs, batches, worker heartbeats).
"""

# NOTE: for a short transition only (branches that still import ``common.schemas``): import from
# the modules. This block goes once every importer does.
from common.schemas.chat import *  # noqa: F403
from common.schemas.checks import *  # noqa: F403
from common.schemas.events import *  # noqa: F403
from common.schemas.requests import *  # noqa: F403
from common.schemas.text import *  # noqa: F403
from common.schemas.views import *  # noqa: F403
