# frozen_string_literal: true

require_relative "../test_helper"
require "json"
require "net/http"

# examples/rails_api as its README runs it: `bin/rails db:prepare` against
# the PostgreSQL bin/test starts, then `neverblock serve
# examples/rails_api/config.ru -p PORT` as a child process (one worker), and
# requests over HTTP. The connection comes from libpq's PG* variables, the
# pool from the example's config/database.yml.
class RailsApiExampleTest < PlainTest
  include ServerProcess
  include NeverBlockTest::Databases

  REPO = File.expand_path("../..", __dir__)
  APP = File.join(REPO, "examples/rails_api")

  def setup
    info = pg_conninfo
    @env = { "PGHOST" => info[:host], "PGPORT" => info[:port].to_s, "PGUSER" => info[:user],
             "PGPASSWORD" => info[:password].to_s, "PGDATABASE" => info[:dbname],
             "RAILS_ENV" => nil, "RACK_ENV" => nil, "RAILS_MAX_THREADS" => nil, "DATABASE_URL" => nil }
    prepare_database
  end

  def test_notes_are_created_listed_and_shown_over_http
    port = serve
    title = "hello #{Process.pid}-#{rand(1_000_000)}"
    created = post_json(port, "/notes", { title: title, body: "from the test" })
    assert_equal "201", created.code, created.body
    note = JSON.parse(created.body)
    assert_equal [title, "from the test"], note.values_at("title", "body")
    assert_equal "/notes/#{note['id']}", URI(created["location"]).path

    shown = get(port, "/notes/#{note['id']}")
    assert_equal "200", shown.code
    assert_equal note, JSON.parse(shown.body)

    listed = JSON.parse(get(port, "/notes?limit=5").body)
    assert_equal note, listed.first, "the newest note comes first"

    wrapped = post_json(port, "/notes", { note: { title: "#{title} again" } })
    assert_equal "201", wrapped.code, wrapped.body

    invalid = post_json(port, "/notes", { body: "no title" })
    assert_equal "422", invalid.code
    assert_equal({ "errors" => { "title" => ["can't be blank"] } }, JSON.parse(invalid.body))

    missing = get(port, "/notes/0")
    assert_equal "404", missing.code
    assert_equal({ "error" => "Note 0 not found" }, JSON.parse(missing.body))
    assert_equal "400", get(port, "/slow?seconds=soon").code

    assert stop_and_wait("TERM").success?, output
  end

  # Ten requests that each spend a second in PostgreSQL, all at once, to
  # one worker process: about a second in all, not ten, each on its own
  # connection of the pool of 25 that database.yml sets.
  def test_ten_slow_requests_at_once_take_about_one_second_in_one_process
    port = serve
    # The pool's connections open first: opening one costs a few queries
    # of ActiveRecord's own (type map, settings), CPU time on this machine,
    # which is not what this test measures.
    Array.new(10) { Thread.new { get(port, "/slow?seconds=0.2") } }.each { |thread| assert_equal "200", thread.value.code }

    responses = nil
    seconds = elapsed do
      responses = Array.new(10) { Thread.new { get(port, "/slow?seconds=1") } }.map(&:value)
    end
    assert_equal ["200"], responses.map(&:code).uniq, responses.map(&:body).uniq.first(2).inspect
    answers = responses.map { |response| JSON.parse(response.body) }
    assert_operator seconds, :<, 3, "ten 1 s queries took #{seconds.round(2)} s (one by one: 10 s)"
    assert_equal 1, answers.map { |answer| answer["worker_pid"] }.uniq.size, "one process served them all"
    assert_equal 10, answers.map { |answer| answer["backend_pid"] }.uniq.size, "ten connections at once"
    assert_equal [25], answers.map { |answer| answer["pool_size"] }.uniq, "the pool of config/database.yml"
    answers.each { |answer| assert_operator answer["seconds"], :>=, 0.95 }

    assert stop_and_wait("TERM").success?, output
  end

  private

  # bin/rails db:prepare, once per process: creates the notes table (from
  # db/schema.rb, or by the migration where the database has others).
  def prepare_database
    return if self.class.instance_variable_get(:@prepared)

    stdout, stderr, status = child_process(RbConfig.ruby, "bin/rails", "db:prepare", env: @env, chdir: APP, timeout: 120)
    assert status.success?, "bin/rails db:prepare failed:\n#{stdout}#{stderr}"
    self.class.instance_variable_set(:@prepared, true)
  end

  # Starts `neverblock serve examples/rails_api/config.ru -p PORT -w 1`.
  # @return [Integer] the port, once the app answers.
  def serve
    port = free_port
    start(RbConfig.ruby, "exe/neverblock", "serve", "examples/rails_api/config.ru", "-p", port.to_s, "-w", "1",
          chdir: REPO, env: @env)
    response = wait_for_answer(port, "/up")
    assert_equal "200", response.code, output
    port
  end

  def get(port, path)
    Net::HTTP.start("127.0.0.1", port, read_timeout: 30) { |http| http.get(path) }
  end

  def post_json(port, path, payload)
    Net::HTTP.start("127.0.0.1", port, read_timeout: 30) do |http|
      http.post(path, JSON.generate(payload), "content-type" => "application/json")
    end
  end
end
