"""From rows to judgement: statistics, verdicts, identifiability, figures and the report page."""
