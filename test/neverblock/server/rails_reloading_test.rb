# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "fileutils"
require "tmpdir"

# Rails' development-mode code reloading with concurrent requests in one
# process: between bursts of concurrent requests a model is edited, and
# every request of every burst must be answered, by the new code. Rails'
# own interlock keys its holders by thread, and all of NeverBlock's requests
# share one (N-1 of N requests sent at once after an edit got 500).
class RailsReloadingTest < PlainTest
  include ServeProcesses

  FIXTURE = File.expand_path("../../fixtures/server/reloading_app", __dir__)
  ROUNDS = 20
  CONCURRENT = 5

  def test_concurrent_requests_around_edits_in_development_all_succeed_with_the_new_code
    Dir.mktmpdir do |dir|
      FileUtils.cp_r("#{FIXTURE}/.", dir)
      server = serve_app(dir)
      answers = ROUNDS.times.flat_map do |round|
        model = File.join(dir, "app", "models", "greeting.rb")
        File.write(model, File.read(model).sub(/version \d+/, "version #{round + 1}"))
        Array.new(CONCURRENT) { Thread.new { get(server, "/greeting") } }.map(&:value).map do |response|
          [round + 1, response.code, response.body.lines.first.to_s.chomp]
        end
      end
      failed = answers.reject { |round, code, body| code == "200" && body == "version #{round}" }
      assert_empty failed, "#{failed.size} of #{answers.size} requests failed or ran old code (round, status, body): " \
                           "#{failed.first(10).inspect}; log:\n#{output_lines(server).grep(/Error|error/).last(20).join}"
    end
  end

  private

  def serve_app(dir)
    serve("config.ru", "-E", "development", "-w", "0", env: { "RAILS_ENV" => "development" }, chdir: dir, timeout: 60)
  end
end
