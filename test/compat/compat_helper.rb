# frozen_string_literal: true

require "test_helper"
require_relative "../support/compat"

# Base class of the compatibility matrix's tests (test/support/compat.rb):
# each test starts its own loop.
class CompatTest < PlainTest
  include CompatMatrix
end
