# frozen_string_literal: true

module NeverBlock
  # The gem's version, following semantic versioning.
  VERSION = "0.1.0"
end
