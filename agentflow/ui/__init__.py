"""The web dashboard the gateway serves at `/ui`: static pages (`static/`, plain ES
modules, nothing fetched from elsewhere) reading the JSON of `/ui/api/` (`routes`),
which `queries` answers from the database and the live runs."""
