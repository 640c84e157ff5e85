# frozen_string_literal: true

module NeverBlock
  # The gem's version, following semantic versioning.
  VERSION = "2.0.0.pre"
end
