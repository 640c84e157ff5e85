# frozen_string_literal: true

require "open3"

module NeverBlockBench
  # Which NeverBlock a benchmark measured: the repository's commit, and
  # whether lib/ had uncommitted changes (the server is measured as it is
  # in the working tree).
  module Checkout
    REPO = File.expand_path("../..", __dir__)

    module_function

    # @return [String] e.g. "commit 91fe21a" or "commit 91fe21a + uncommitted changes in lib/"
    def description
      commit, ok = Open3.capture2("git", "-C", REPO, "rev-parse", "--short", "HEAD")
      return "commit unknown (not a git checkout)" unless ok.success?

      changes, = Open3.capture2("git", "-C", REPO, "status", "--porcelain", "--", "lib")
      "commit #{commit.strip}#{changes.strip.empty? ? '' : ' + uncommitted changes in lib/'}"
    rescue SystemCallError
      "commit unknown (no git)"
    end
  end
end
