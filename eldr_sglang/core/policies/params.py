"""The policies' parameter sets: :mod:`eldr_sglang.core.params` (where the step-time law's
fields are declared too), under the name the policies have always used."""

from eldr_sglang.core.params import (NoParams, Params, bounds, check_fields, check_int, check_number,  # noqa: F401
                                     check_params, param, param_docs, param_of, param_names, params_for, parse_params,
                                     split_assignments)
