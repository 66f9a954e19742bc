"""Search environment: the rollout protocol, the verl search tool and agent loop, the verl glue
shared by training and evaluation, rollout statistics and dataset preparation. Subpackage
`retrieval`: the retrieval service."""
