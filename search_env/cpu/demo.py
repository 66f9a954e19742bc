"""Deprecated name of ``search_demo.driver`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.driver", __name__ == "__main__", "search_demo")
