"""HTTP toward clients: bodies and their rules, client conventions (API key, request ids, OpenAI errors, CORS, access log), connection guards, answers, serving on a port."""
