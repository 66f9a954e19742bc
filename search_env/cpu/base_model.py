"""Deprecated name of ``search_demo.base_model`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.base_model", __name__ == "__main__")
