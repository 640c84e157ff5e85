# frozen_string_literal: true

class ApplicationController < ActionController::API
  rescue_from ActiveRecord::RecordNotFound do |error|
    render json: { error: "#{error.model || 'record'} #{error.id} not found" }, status: :not_found
  end
end
