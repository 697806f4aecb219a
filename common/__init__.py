"""The contract the API and the workers share: settings, Redis names, schemas, the job store."""
