# frozen_string_literal: true

require "net/http"

# A call to a slow API (an LLM's answer): a GET of the fake one that answers after `seconds`.
# With NB_JOBS_LIMIT (bench/jobs.rb's fleet part), each call holds a permit of a
# NeverBlock::RedisSemaphore of that many, shared by every job process through REDIS_URL.
class LlmCallJob < ActiveJob::Base
  UPSTREAM = URI(ENV.fetch("NB_JOBS_UPSTREAM", "http://127.0.0.1:9292"))
  LIMIT = (Integer(ENV["NB_JOBS_LIMIT"]) if ENV["NB_JOBS_LIMIT"])
  if LIMIT
    require "neverblock/redis_semaphore"
    CALLS = NeverBlock::RedisSemaphore.new("bench-jobs-llm-#{ENV.fetch('NB_JOBS_RUN', 'run')}", LIMIT, url: ENV.fetch("REDIS_URL"))
  end

  def perform(seconds)
    LIMIT ? CALLS.acquire(timeout: 600) { call(seconds) } : call(seconds)
  end

  private

  def call(seconds)
    response = Net::HTTP.get_response(UPSTREAM.dup.tap { |url| url.path, url.query = "/wait", "seconds=#{seconds}" })
    raise "the API answered #{response.code}" unless response.is_a?(Net::HTTPSuccess)
  end
end
