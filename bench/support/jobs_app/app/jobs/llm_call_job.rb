# frozen_string_literal: true

require "net/http"

# A call to a slow API (an LLM's answer): a GET of the fake one that answers after `seconds`.
class LlmCallJob < ActiveJob::Base
  UPSTREAM = URI(ENV.fetch("NB_JOBS_UPSTREAM", "http://127.0.0.1:9292"))

  def perform(seconds)
    response = Net::HTTP.get_response(UPSTREAM.dup.tap { |url| url.path, url.query = "/wait", "seconds=#{seconds}" })
    raise "the API answered #{response.code}" unless response.is_a?(Net::HTTPSuccess)
  end
end
